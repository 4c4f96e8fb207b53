//! Scheduler plus KV-manager time per engine step: 256 requests running (continuous batching:
//! each finished request is replaced at once), with a 1M-token prefix cache. Prints p50/p99 of
//! 5,000 timed steps, then runs criterion on the same loop.
//! Run: `cargo bench -p kvgate-worker --bench step`
//!
//! Each timed step includes the sim backend's own work (one roofline formula, one hash per
//! sampled token) and the replacement of finished requests; nothing sleeps.
// Benchmarks are not request paths: failing loudly is what they should do.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use criterion::Criterion;
use kvgate_protocol::HashSeed;
use kvgate_worker::backend::profile::Profile;
use kvgate_worker::backend::sim::SimBackend;
use kvgate_worker::sched::SchedulerConfig;
use kvgate_worker::{Engine, EngineConfig, NewRequest, SamplingParams};
use std::hint::black_box;
use std::path::Path;
use std::time::Instant;

const BLOCK: usize = 16;
const CACHED_TOKENS: usize = 1 << 20;
const RUNNING: u64 = 256;

struct Workload {
    engine: Engine<SimBackend>,
    next_id: u64,
}

impl Workload {
    fn new() -> Workload {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../config/profiles/h200-llama-3.1-8b-bf16.yaml");
        let profile = Profile::load(&path).unwrap_or_else(|e| panic!("{e}"));
        let config = EngineConfig {
            block_size: BLOCK,
            // The cached million tokens, plus room for the running requests.
            num_blocks: Some(CACHED_TOKENS / BLOCK + RUNNING as usize * 48),
            max_model_len: 1 << 16,
            prefix_caching: true,
            scheduler: SchedulerConfig {
                max_num_batched_tokens: 16_384,
                max_num_seqs: 512,
                ..Default::default()
            },
            hash_seed: HashSeed::new("bench", None, ""),
            eos_token_ids: vec![],
        };
        let mut w = Workload {
            engine: Engine::new(config, SimBackend::new(profile, 17, 49152)).unwrap(),
            next_id: 0,
        };
        // Fill the prefix cache: 2,048 finished prompts of 512 tokens.
        for _ in 0..CACHED_TOKENS / 512 {
            w.add(512, 1);
            while w.engine.has_work() {
                w.engine.step().unwrap_or_else(|err| panic!("{err}"));
            }
        }
        // 256 running requests with staggered lengths, so they finish at different steps.
        for r in 0..RUNNING {
            w.add(256 + (r % 16) as u32, 64 + (r * 7 % 256) as u32);
        }
        for _ in 0..10 {
            w.step();
        }
        let s = w.engine.stats();
        assert_eq!(s.running, RUNNING as usize);
        assert!(
            s.kv_blocks_cached * BLOCK >= CACHED_TOKENS,
            "cache holds {} blocks",
            s.kv_blocks_cached
        );
        w
    }

    fn add(&mut self, prompt_len: u32, max_tokens: u32) {
        let id = self.next_id;
        self.next_id += 1;
        let prompt = (0..prompt_len)
            .map(|k| 17 + ((id as u32).wrapping_mul(7919) + k) % 49_000)
            .collect();
        let params = SamplingParams {
            max_tokens,
            ignore_eos: true,
            ..Default::default()
        };
        self.engine
            .add_request(NewRequest {
                id,
                prompt,
                params,
                priority: 0,
            })
            .unwrap_or_else(|err| panic!("{err}"));
    }

    /// One step, replacing the requests it finished.
    fn step(&mut self) -> usize {
        let out = self.engine.step().unwrap_or_else(|err| panic!("{err}"));
        let finished = out.tokens.iter().filter(|t| t.finished.is_some()).count();
        for i in 0..finished {
            self.add(256 + (i % 16) as u32, 256);
        }
        out.tokens.len()
    }
}

fn main() {
    let mut w = Workload::new();
    let mut samples: Vec<u64> = (0..5_000)
        .map(|_| {
            let t = Instant::now();
            black_box(w.step());
            t.elapsed().as_nanos() as u64
        })
        .collect();
    samples.sort_unstable();
    let pct = |p: f64| {
        samples[((samples.len() as f64 * p) as usize).min(samples.len() - 1)] as f64 / 1000.0
    };
    let s = w.engine.stats();
    println!(
        "step, {} running, {} cached blocks, {} preemptions: p50 {:.1} µs, p99 {:.1} µs, p99.9 {:.1} µs",
        s.running,
        s.kv_blocks_cached,
        s.preemptions,
        pct(0.5),
        pct(0.99),
        pct(0.999)
    );
    let mut c = Criterion::default().configure_from_args();
    c.bench_function("step/256_running_1M_cached", |b| {
        b.iter(|| black_box(w.step()))
    });
    c.final_summary();
}
