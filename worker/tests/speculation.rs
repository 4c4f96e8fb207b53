//! Speculative decoding in the engine: drafts appended, verified, rolled back. On the sim
//! backend (exact verification against its deterministic model, at any acceptance rate the
//! drafter is given): the output is the same with speculation as without, nothing leaks under
//! any pattern of acceptance, rejection and abort, and no unverified block is ever cached.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvgate_protocol::kv_events::KvEvent;
use kvgate_protocol::HashSeed;
use kvgate_worker::backend::sim::{SimBackend, SimDrafter};
use kvgate_worker::backend::Backend;
use kvgate_worker::sched::SchedulerConfig;
use kvgate_worker::spec::{Draft, DraftAsk, Drafter, Method, NgramSettings, SpecConfig};
use kvgate_worker::{Engine, EngineConfig, NewRequest, SamplingParams};
use std::collections::HashMap;

mod common;

const BLOCK: usize = 16;

fn sim() -> SimBackend {
    SimBackend::new(common::sim_profile(), 17, 49152)
}

fn engine(num_blocks: usize) -> Engine<SimBackend> {
    let config = EngineConfig {
        block_size: BLOCK,
        num_blocks: Some(num_blocks),
        max_model_len: 1024,
        prefix_caching: true,
        scheduler: SchedulerConfig {
            max_num_batched_tokens: 256,
            max_num_seqs: 32,
            ..Default::default()
        },
        hash_seed: HashSeed::new("test", None, ""),
        eos_token_ids: vec![],
    };
    Engine::new(config, sim()).unwrap()
}

fn speculative(num_blocks: usize, acceptance: f64, tokens: usize) -> Engine<SimBackend> {
    let mut e = engine(num_blocks);
    let config = SpecConfig::new(
        Method::Ngram,
        tokens,
        NgramSettings::new(2, 4).unwrap(),
        None,
    )
    .unwrap();
    e.enable_speculation_with(config, Box::new(SimDrafter::new(sim(), acceptance)));
    e
}

/// SplitMix64: a reproducible stream for the workloads below.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        (z ^ (z >> 31)) % n
    }
}

/// One random workload, the same on every engine given the same seed: requests sharing four
/// prefixes arrive, the engine steps, some requests are aborted. Returns the output of every
/// request that was not aborted, checking the pool after every step.
fn drive(e: &mut Engine<SimBackend>, seed: u64, requests: u64) -> HashMap<u64, Vec<u32>> {
    let mut rng = Rng(seed);
    let mut out: HashMap<u64, Vec<u32>> = HashMap::new();
    let mut aborted = Vec::new();
    let mut next = 0;
    while next < requests || e.has_work() {
        match rng.below(8) {
            0 | 1 if next < requests => {
                let prefix = rng.below(4) as u32;
                let len = 1 + rng.below(200) as u32;
                let prompt = (0..len)
                    .map(|i| {
                        if i < 48 {
                            prefix * 100 + i
                        } else {
                            1_000 + next as u32 * 7 + i
                        }
                    })
                    .collect();
                let params = SamplingParams {
                    max_tokens: 1 + rng.below(80) as u32,
                    ..Default::default()
                };
                e.add_request(NewRequest {
                    id: next,
                    prompt,
                    params,
                    priority: 0,
                })
                .unwrap();
                next += 1;
            }
            // Aborts only while requests arrive, so that both engines see the same ones.
            2 if next > 0 && next < requests && rng.below(6) == 0 => {
                let id = rng.below(next);
                e.abort(id);
                aborted.push(id);
            }
            _ => {
                for t in e.step().unwrap().tokens {
                    out.entry(t.id).or_default().push(t.token);
                }
                e.check_kv().unwrap();
                // A rejected draft's blocks go back at once.
                for id in 0..next {
                    if let Some(r) = e.request(id) {
                        assert!(r.kv.ids().len() <= r.tokens.len().div_ceil(BLOCK), "{id}");
                    }
                }
            }
        }
    }
    for id in aborted {
        out.remove(&id);
    }
    out
}

#[test]
fn speculation_changes_no_token_and_leaks_no_block() {
    let mut drafts = 0;
    for (round, acceptance) in [0.0, 0.3, 0.6, 0.8, 0.95, 1.0].into_iter().enumerate() {
        for seed in 0..4u64 {
            let seed = seed * 101 + round as u64;
            // A pool small enough that requests are preempted and drafts find no room.
            let plain = drive(&mut engine(96), seed, 60);
            let mut e = speculative(96, acceptance, 1 + round * 3);
            let fast = drive(&mut e, seed, 60);
            assert_eq!(plain, fast, "acceptance {acceptance}, seed {seed}");
            let stats = e.stats();
            assert_eq!(
                (stats.kv_blocks_free, stats.running, stats.waiting),
                (stats.kv_blocks_total, 0, 0),
                "acceptance {acceptance}, seed {seed}: blocks left held"
            );
            drafts += stats.spec.drafts;
            if acceptance == 1.0 {
                assert_eq!(stats.spec.accepted_tokens, stats.spec.draft_tokens);
            }
        }
    }
    assert!(drafts >= 10_000, "only {drafts} drafts verified");
}

#[test]
fn drafts_are_counted_per_position_and_follow_acceptance() {
    let mut sure = speculative(512, 0.9, 8);
    drive(&mut sure, 7, 40);
    let mut doubtful = speculative(512, 0.1, 8);
    drive(&mut doubtful, 7, 40);
    let (s, d) = (sure.stats().spec, doubtful.stats().spec);
    assert!(s.drafts > 0 && d.drafts > 0, "{s:?} {d:?}");
    // Position counts fall with the position and add up to the accepted tokens.
    assert!(s.accepted_per_pos.windows(2).all(|w| w[0] >= w[1]), "{s:?}");
    assert_eq!(s.accepted_per_pos.iter().sum::<u64>(), s.accepted_tokens);
    assert!(s.accepted_per_pos[0] <= s.drafts);
    // Drafts shrink where they fail: fewer tokens per draft, and a shorter acceptance length.
    let per_draft =
        |x: &kvgate_protocol::worker_stats::SpecStats| x.draft_tokens as f64 / x.drafts as f64;
    assert!(per_draft(&d) < per_draft(&s), "{d:?} against {s:?}");
    assert!(
        d.mean_acceptance_length().unwrap() < s.mean_acceptance_length().unwrap(),
        "{d:?} against {s:?}"
    );
}

/// Where a one-token draft pays and longer ones pay only if kept in runs (this AMD EPYC's
/// measured costs), drafts that are always kept grow past one token: the engine tries the
/// later tokens it has not seen yet rather than valuing them at a prior that never learns.
#[test]
fn drafts_kept_in_runs_grow_past_one_token() {
    let mut e = engine(512);
    let config =
        SpecConfig::new(Method::Ngram, 8, NgramSettings::new(2, 4).unwrap(), None).unwrap();
    let costs = kvgate_worker::spec::StepCosts::from_points(vec![
        (1, 1.0),
        (2, 1.45),
        (3, 1.95),
        (4, 2.25),
        (6, 3.2),
        (8, 3.2),
    ])
    .unwrap();
    e.enable_speculation_at(config, Box::new(SimDrafter::new(sim(), 1.0)), costs);
    e.add_request(NewRequest {
        id: 1,
        prompt: (0..64).collect(),
        params: SamplingParams {
            max_tokens: 400,
            ignore_eos: true,
            ..Default::default()
        },
        priority: 0,
    })
    .unwrap();
    while e.has_work() {
        e.step().unwrap();
    }
    let s = e.stats().spec;
    assert!(
        s.accepted_per_pos[1] * 2 > s.drafts,
        "most drafts longer than one token: {s:?}"
    );
}

/// Right from one source, wrong from the other (as the suffix drafter's own context and shared
/// cache can be on open chat), alternating by the context's length.
#[derive(Clone)]
struct TwoSources {
    right: SimDrafter,
    wrong: SimDrafter,
}

impl Drafter for TwoSources {
    fn propose(&mut self, context: &[u32], k: usize) -> Vec<u32> {
        self.propose_batch(&[DraftAsk {
            id: 0,
            context,
            num_prompt_tokens: 0,
            k,
        }])
        .swap_remove(0)
        .tokens
    }

    fn propose_batch(&mut self, asks: &[DraftAsk<'_>]) -> Vec<Draft> {
        asks.iter()
            .map(|a| {
                let source = a.context.len() % 2;
                let drafter = if source == 0 {
                    &mut self.right
                } else {
                    &mut self.wrong
                };
                Draft {
                    tokens: drafter.propose(a.context, a.k),
                    source,
                }
            })
            .collect()
    }

    fn clone_box(&self) -> Box<dyn Drafter> {
        Box::new(self.clone())
    }
}

/// A source whose drafts fail stops being verified while the other's still are: each source
/// has its own running rates (shared ones would value both at the mix).
#[test]
fn a_failing_source_stops_drafting_while_a_good_one_goes_on() {
    let mut e = engine(512);
    let config =
        SpecConfig::new(Method::Ngram, 4, NgramSettings::new(2, 4).unwrap(), None).unwrap();
    let costs =
        kvgate_worker::spec::StepCosts::from_points(vec![(1, 1.0), (2, 1.45), (5, 2.9)]).unwrap();
    let drafter = TwoSources {
        right: SimDrafter::new(sim(), 1.0),
        wrong: SimDrafter::new(sim(), 0.0),
    };
    e.enable_speculation_at(config, Box::new(drafter), costs);
    for id in 0..4 {
        e.add_request(NewRequest {
            id,
            prompt: (0..64).map(|t| t + id as u32 * 100).collect(),
            params: SamplingParams {
                max_tokens: 300,
                ignore_eos: true,
                ..Default::default()
            },
            priority: 0,
        })
        .unwrap();
        while e.has_work() {
            e.step().unwrap();
        }
    }
    let s = e.stats().spec;
    let kept = s.accepted_tokens as f64 / s.draft_tokens as f64;
    assert!(
        s.drafts > 50 && kept > 0.8,
        "{kept:.2} of drafted tokens kept: {s:?}"
    );
}

/// A cached block holds the KV of verified tokens only: every block announced as stored is
/// full of tokens whose KV was computed (below the request's last token, which never is).
#[test]
fn no_unverified_block_is_cached_or_announced() {
    let mut e = speculative(1024, 0.5, 8);
    let mut checked = 0;
    for id in 0..8u64 {
        e.add_request(NewRequest {
            id,
            prompt: (0..40 + id as u32 * 5)
                .map(|i| id as u32 * 1000 + i)
                .collect(),
            params: SamplingParams {
                max_tokens: 300,
                ..Default::default()
            },
            priority: 0,
        })
        .unwrap();
    }
    while e.has_work() {
        let out = e.step().unwrap();
        let stored: Vec<u64> = out
            .kv_events
            .iter()
            .flat_map(|ev| match ev {
                KvEvent::Stored { hashes, .. } => hashes.clone(),
                _ => Vec::new(),
            })
            .collect();
        for hash in stored {
            for id in 0..8 {
                let Some(r) = e.request(id) else { continue };
                if let Some(k) = r.block_hashes.iter().position(|&h| h == hash) {
                    assert!(
                        (k + 1) * BLOCK < r.tokens.len(),
                        "request {id}: block {k} cached with {} tokens known",
                        r.tokens.len()
                    );
                    checked += 1;
                }
            }
        }
    }
    assert!(e.stats().spec.drafts > 100);
    assert!(checked > 100, "only {checked} stored blocks checked");
}

/// The 20 golden prompts and 180 more: input-grounded (repeat, rewrite or reformat a given
/// text, answer from a passage), where drafts are kept often, and open questions, where they
/// rarely are; chat-rendered, plus a few raw completions.
fn two_hundred_prompts(model: &kvgate_worker::model::ModelFile) -> Vec<Vec<u32>> {
    use kvgate_worker::model::template::TemplateMessage;
    const WORDS: &[&str] = &[
        "river", "engine", "garden", "signal", "copper", "window", "market", "lantern", "harbor",
        "theory", "pencil", "orbit", "meadow", "ladder", "castle", "needle",
    ];
    let mut rng = Rng(17);
    let mut words = |n: usize| -> String {
        (0..n)
            .map(|_| WORDS[rng.below(WORDS.len() as u64) as usize])
            .collect::<Vec<_>>()
            .join(" ")
    };
    let mut prompts: Vec<Vec<u32>> = common::golden().cases.iter().map(common::ids).collect();
    let tokenizer = &model.prompt.tokenizer;
    let template = model.prompt.template.as_ref().unwrap();
    for i in 0..180 {
        let passage = words(12 + i % 20);
        let (a, b) = (words(1), words(1));
        let text = match i % 6 {
            0 => format!("Repeat the following text exactly:\n{passage}"),
            1 => format!(
                "Rename the variable `{a}` to `{b}` and return the whole function:\n```python\ndef {a}_total({a}):\n    total = 0\n    for item in {a}:\n        total += item\n    return total\n```"
            ),
            2 => format!(
                "Reformat this JSON with two-space indentation:\n{{\"name\": \"{a}\", \"tags\": [\"{b}\", \"{a}\"], \"note\": \"{passage}\"}}"
            ),
            3 => format!("{passage}\n\nQuestion: which word comes after \"{a}\" in the text above?"),
            4 => format!("Write a short poem about a {a} and a {b}."),
            _ => {
                prompts.push(
                    tokenizer
                        .encode(&format!("{passage}, {passage}, {}", words(3)), true)
                        .unwrap(),
                );
                continue;
            }
        };
        let messages = [TemplateMessage {
            role: "user".into(),
            content: text,
        }];
        let rendered = template.render(&messages).unwrap();
        prompts.push(tokenizer.encode(&rendered, true).unwrap());
    }
    prompts
}

/// Greedy outputs of `prompts`, run `together` at a time on one engine (so that a suffix
/// cache learns from the groups before).
fn outputs(
    e: &mut Engine<kvgate_worker::backend::cpu::CpuBackend>,
    prompts: &[Vec<u32>],
    together: usize,
) -> Vec<Vec<u32>> {
    let mut out = vec![Vec::new(); prompts.len()];
    for (group, chunk) in prompts.chunks(together).enumerate() {
        for (j, prompt) in chunk.iter().enumerate() {
            e.add_request(NewRequest {
                id: (group * together + j) as u64,
                prompt: prompt.clone(),
                params: common::greedy(16),
                priority: 0,
            })
            .unwrap();
        }
        while e.has_work() {
            for t in e.step().unwrap().tokens {
                out[t.id as usize].push(t.token);
            }
        }
        e.check_kv().unwrap();
    }
    out
}

/// Greedy output on the real model is token for token the same with each drafter as without,
/// alone and batched with 16 others. Step costs are flat here so that every draft is
/// verified, however unlikely (the measured costs would skip many). One engine runs every
/// pass, its cache large enough to keep the prompts, so only the first pass computes them.
#[test]
fn greedy_output_on_the_model_is_the_same_with_each_drafter() {
    let model = kvgate_worker::model::ModelFile::open(&common::default_model()).unwrap();
    let prompts = two_hundred_prompts(&model);
    assert_eq!(prompts.len(), 200);
    let mut e = common::engine_with_cache(&model, 2, 1 << 30);
    let plain = outputs(&mut e, &prompts, 17);
    let flat = kvgate_worker::spec::StepCosts::from_points(vec![(1, 1.0), (512, 1.0)]).unwrap();
    let ngram = NgramSettings::new(2, 4).unwrap();
    let methods = [
        Method::Ngram,
        Method::Suffix {
            entries: std::num::NonZeroUsize::new(100_000).unwrap(),
        },
        // The target drafting for itself: nearly every draft kept, which a cut copy (the
        // draft model's own test) almost never is.
        Method::Draft {
            model: common::default_model(),
            kv_cache_bytes: 256 << 20,
        },
    ];
    for method in methods {
        let config = SpecConfig::new(method.clone(), 4, ngram, None).unwrap();
        // One drafter for both passes: the suffix cache learns across them, as a worker's.
        let drafter = match config.drafter() {
            Some(drafter) => drafter,
            None => Box::new(common::Free(e.backend_mut().drafter(&method).unwrap())),
        };
        e.enable_speculation_at(config.clone(), drafter, flat.clone());
        for together in [1, 17] {
            let before = e.stats().spec;
            let fast = outputs(&mut e, &prompts, together);
            for (i, (p, f)) in plain.iter().zip(&fast).enumerate() {
                assert_eq!(p, f, "{method:?}, {together} at a time: prompt {i}");
            }
            let after = e.stats().spec;
            let (drafted, kept) = (
                after.draft_tokens - before.draft_tokens,
                after.accepted_tokens - before.accepted_tokens,
            );
            let rejects = matches!(method, Method::Draft { .. }) || kept < drafted;
            assert!(
                kept > 200 && kept <= drafted && rejects,
                "{method:?}, {together} at a time: drafts kept and rejected both: {kept} of {drafted}"
            );
        }
    }
}
