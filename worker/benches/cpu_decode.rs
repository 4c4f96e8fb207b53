//! CPU backend speed in llama-bench's terms: `pp512` (prompt processing, tokens/s over a
//! 512-token prompt) and `tg128` (single-stream generation, tokens/s over 128 tokens), on the
//! default GGUF, plus the fraction of the memory-bandwidth roofline reached at batch 1 (weight
//! bytes read per token times tokens/s, over a streaming-read bandwidth measured in the same
//! run). Threads: `KVGATE_THREADS` (default 1). Repetitions: 3, best reported as llama-bench
//! reports its mean; both are printed.
//! Run: `cargo bench -p kvgate-worker --bench cpu_decode`

// Benchmarks are not request paths: failing loudly is what they should do.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use kvgate_protocol::HashSeed;
use kvgate_worker::backend::cpu::{CpuBackend, CpuConfig};
use kvgate_worker::model::ModelFile;
use kvgate_worker::sched::SchedulerConfig;
use kvgate_worker::{Engine, EngineConfig, NewRequest, SamplingParams};
use std::hint::black_box;
use std::path::PathBuf;
use std::time::Instant;

fn main() {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let threads: usize = std::env::var("KVGATE_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let model = ModelFile::open(&path).unwrap();
    let config = CpuConfig {
        threads,
        kv_cache_bytes: 256 << 20,
        block_size: 16,
    };
    let mut engine = Engine::new(
        EngineConfig {
            block_size: 16,
            num_blocks: None,
            max_model_len: 2048,
            prefix_caching: false,
            scheduler: SchedulerConfig {
                max_num_batched_tokens: 512,
                max_num_seqs: 16,
                ..Default::default()
            },
            hash_seed: HashSeed::new("bench", None, ""),
            eos_token_ids: vec![],
        },
        CpuBackend::load(&path, &model, &config).unwrap(),
    )
    .unwrap();
    let isa = engine.backend().isa().name();
    let bytes_per_token = engine.backend().bytes_per_token();
    let mut id = 0u64;
    // 16 streams decoding together (the engine's batched step, no HTTP): output tokens/s.
    let mut batched = |streams: u64, gen: u32| -> f64 {
        for _ in 0..streams {
            id += 1;
            engine.add_request(greedy(id, 32, gen)).unwrap();
        }
        // Prompts first (each samples its first token), then time the decode steps alone.
        engine.step().unwrap();
        let t = Instant::now();
        while engine.has_work() {
            black_box(engine.step().unwrap());
        }
        streams as f64 * f64::from(gen - 1) / t.elapsed().as_secs_f64()
    };
    let streams16: Vec<f64> = (0..3).map(|_| batched(16, 65)).collect();
    let mut rate = |prompt_len: usize, gen: u32| -> f64 {
        id += 1;
        engine.add_request(greedy(id, prompt_len, gen)).unwrap();
        // The prompt step (pp) ends with the first sampled token; generation steps follow.
        let t = Instant::now();
        engine.step().unwrap();
        let pp = t.elapsed().as_secs_f64();
        let t = Instant::now();
        while engine.has_work() {
            black_box(engine.step().unwrap());
        }
        let tg = t.elapsed().as_secs_f64();
        if gen > 1 {
            f64::from(gen - 1) / tg
        } else {
            prompt_len as f64 / pp
        }
    };
    let pp: Vec<f64> = (0..3).map(|_| rate(512, 1)).collect();
    let tg: Vec<f64> = (0..3).map(|_| rate(1, 129)).collect();
    let bandwidth = stream_bandwidth();
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let best = |v: &[f64]| v.iter().cloned().fold(0.0, f64::max);
    println!("kvgate cpu backend, SmolLM2-135M-Instruct Q4_1, {threads} thread(s), isa {isa}");
    println!("pp512: mean {:.1} tok/s, best {:.1}", mean(&pp), best(&pp));
    println!("tg128: mean {:.1} tok/s, best {:.1}", mean(&tg), best(&tg));
    println!(
        "16 streams decoding: mean {:.1} tok/s, best {:.1}",
        mean(&streams16),
        best(&streams16)
    );
    let used = bytes_per_token as f64 * mean(&tg);
    println!(
        "roofline at batch 1: {:.1} MB read per token x {:.1} tok/s = {:.2} GB/s of {:.2} GB/s measured streaming = {:.0} %",
        bytes_per_token as f64 / 1e6,
        mean(&tg),
        used / 1e9,
        bandwidth / 1e9,
        100.0 * used / bandwidth
    );
}

/// Request `id`: a `prompt_len`-token prompt of ids that differ per request, `gen` greedy tokens.
fn greedy(id: u64, prompt_len: usize, gen: u32) -> NewRequest {
    NewRequest {
        id,
        prompt: (0..prompt_len)
            .map(|i| 17 + (i as u32 * 7919 + id as u32) % 49_000)
            .collect(),
        params: SamplingParams {
            max_tokens: gen,
            temperature: 0.0,
            ignore_eos: true,
            ..Default::default()
        },
        priority: 0,
    }
}

/// Single-thread streaming read bandwidth: sums a 512 MiB buffer, best of 3.
fn stream_bandwidth() -> f64 {
    let buf = vec![1u64; 64 << 20];
    (0..3)
        .map(|_| {
            let t = Instant::now();
            let sum: u64 = black_box(&buf).iter().fold(0u64, |a, b| a.wrapping_add(*b));
            black_box(sum);
            (buf.len() * 8) as f64 / t.elapsed().as_secs_f64()
        })
        .fold(0.0, f64::max)
}
