//! Perfect, instant knowledge of every replica, one request at a time: each request goes where
//! its first token comes soonest, found by stepping a copy of each replica's engine — its own
//! scheduler, KV manager and step model — with the request added, until that token. No router
//! could be deployed like this. It is greedy (each request its own soonest; later arrivals
//! unknown), so it is not a bound under load: it is where the oracle's search starts.

use kvgate_worker::backend::sim::SimBackend;
use kvgate_worker::{Engine, NewRequest};

/// Most steps looked ahead on one replica: one that far from the first token is never chosen.
const MAX_STEPS: usize = 100_000;

/// Modelled seconds until `request`'s first token on `engine`, whose step under way ends in
/// `busy_s`; `None` when the engine refuses the request (or it would take over [`MAX_STEPS`]).
pub fn first_token_seconds(
    engine: &Engine<SimBackend>,
    request: NewRequest,
    busy_s: f64,
) -> Option<f64> {
    let mut copy = engine.fork();
    let id = request.id;
    copy.add_request(request).ok()?;
    let mut seconds = busy_s;
    for _ in 0..MAX_STEPS {
        let out = copy.step().ok()?;
        seconds += out.modelled_duration.map_or(0.0, |d| d.as_secs_f64());
        if out.tokens.iter().any(|t| t.id == id) {
            return Some(seconds);
        }
        if !copy.has_work() {
            return None;
        }
    }
    None
}

/// The replica whose first token comes soonest (ties: the `start`-th of the tied, modulo
/// their number).
pub fn choose(seconds: &[Option<f64>], start: usize) -> usize {
    let at = |r: usize| seconds[r].unwrap_or(f64::INFINITY);
    crate::peers::best_of(seconds.len(), start as u64, at, true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvgate_protocol::HashSeed;
    use kvgate_worker::backend::profile::Profile;
    use kvgate_worker::{EngineConfig, SamplingParams};

    fn engine() -> Engine<SimBackend> {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../config/profiles/h200-llama-3.1-8b-bf16.yaml"
        );
        let profile = Profile::load(std::path::Path::new(path)).unwrap();
        let config = EngineConfig {
            block_size: 16,
            num_blocks: Some(1_024),
            max_model_len: 8_192,
            prefix_caching: true,
            scheduler: Default::default(),
            hash_seed: HashSeed::new("m", None, ""),
            eos_token_ids: Vec::new(),
        };
        Engine::new(config, SimBackend::new(profile, 1_000, 32_000)).unwrap()
    }

    fn request(id: u64, prompt: Vec<u32>) -> NewRequest {
        NewRequest {
            id,
            prompt,
            params: SamplingParams {
                max_tokens: 8,
                ignore_eos: true,
                ..Default::default()
            },
            priority: 0,
        }
    }

    #[test]
    fn the_holder_wins_until_its_queue_costs_more_than_the_prefill() {
        let shared: Vec<u32> = (1_000..3_048).collect();
        let (cold, mut warm) = (engine(), engine());
        warm.add_request(request(1, shared.clone())).unwrap();
        while warm.has_work() {
            warm.step().unwrap();
        }
        let mut prompt = shared.clone();
        prompt.extend(5_000..5_064);
        let soonest = |engines: [&Engine<SimBackend>; 2], busy: [f64; 2]| {
            let s: Vec<Option<f64>> = engines
                .iter()
                .zip(busy)
                .map(|(e, b)| first_token_seconds(e, request(9, prompt.clone()), b))
                .collect();
            (choose(&s, 0), s)
        };
        // Both idle: the one holding 2,048 of 2,112 tokens.
        assert_eq!(soonest([&cold, &warm], [0.0, 0.0]).0, 1);
        // Its step under way ends in a second: the cold one is sooner.
        let (choice, s) = soonest([&cold, &warm], [0.0, 1.0]);
        assert_eq!(choice, 0, "{s:?}");
        // Looking ahead changed nothing.
        assert_eq!(warm.stats().running + warm.stats().waiting, 0);
        // Queued prompts count too: 16k tokens ahead on the warm one.
        let mut busy = warm.fork();
        for id in 20..28 {
            busy.add_request(request(
                id,
                (0..2_048).map(|t| 40_000 + t + id as u32 * 3_000).collect(),
            ))
            .unwrap();
        }
        assert_eq!(soonest([&cold, &busy], [0.0, 0.0]).0, 0);
        // A prompt no engine takes is never chosen.
        assert_eq!(
            first_token_seconds(&cold, request(30, vec![7; 9_000]), 0.0),
            None
        );
    }
}
