//! What a speculative verification step costs on the CPU backend: steps of `n` tokens per
//! request (one decoded token plus `n - 1` drafted, every position's logits computed) after a
//! context of `KVGATE_CONTEXT` tokens (default 256), for 1, 4 and 16 requests at once, each
//! relative to the one-token step of the same batch. Cells are timed round-robin over
//! `KVGATE_ROUNDS` rounds (default 7) and the median kept, so that a VM's drift spreads over
//! every cell alike. The ratio bounds what speculation can gain: a draft of `n - 1` tokens all
//! kept yields `n` tokens for that cost.
//! Threads: `KVGATE_THREADS` (default 1).
//! Run: `cargo bench -p kvgate-worker --bench verify_step`

// Benchmarks are not request paths: failing loudly is what they should do.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use kvgate_worker::backend::cpu::{CpuBackend, CpuConfig};
use kvgate_worker::backend::{Backend, BatchSlice};
use kvgate_worker::model::ModelFile;
use kvgate_worker::SamplingParams;
use std::path::PathBuf;
use std::time::Instant;

const BLOCK: usize = 16;

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A comma-separated list from the environment (for profiling one cell), else `default`.
fn env_list(name: &str, default: &[usize]) -> Vec<usize> {
    std::env::var(name)
        .ok()
        .map(|v| v.split(',').filter_map(|n| n.trim().parse().ok()).collect())
        .filter(|v: &Vec<usize>| !v.is_empty() && !v.contains(&0))
        .unwrap_or_else(|| default.to_vec())
}

fn main() {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let threads = env("KVGATE_THREADS", 1);
    let context = env("KVGATE_CONTEXT", 256);
    let rounds = env("KVGATE_ROUNDS", 7);
    // The first size is the base of each row's ratios.
    let sizes = env_list("KVGATE_SIZES", &[1, 2, 3, 4, 5, 6, 8, 10, 12, 16]);
    let batches = env_list("KVGATE_BATCHES", &[1, 4, 16]);
    let model = ModelFile::open(&path).unwrap();
    let config = CpuConfig {
        threads,
        kv_cache_bytes: 512 << 20,
        block_size: BLOCK,
    };
    let mut backend = CpuBackend::load(&path, &model, &config).unwrap();
    let max_batch = batches.iter().copied().max().unwrap_or(1);
    let per_seq = (context + sizes.iter().copied().max().unwrap_or(1)).div_ceil(BLOCK);
    let tokens: Vec<Vec<u32>> = (0..max_batch as u32)
        .map(|s| {
            (0..(per_seq * BLOCK) as u32)
                .map(|i| 17 + (i * 7919 + s * 104_729) % 49_000)
                .collect()
        })
        .collect();
    let tables: Vec<Vec<u32>> = (0..max_batch)
        .map(|s| {
            (1 + s * per_seq..1 + (s + 1) * per_seq)
                .map(|b| b as u32)
                .collect()
        })
        .collect();
    let params = SamplingParams::default();
    let slices = |batch: usize, start: usize, len: usize, draft: usize| -> Vec<BatchSlice<'_>> {
        (0..batch)
            .map(|s| BatchSlice {
                id: s as u64,
                // Shaped as the engine's steps: the context as the prompt, then one sampled
                // token and the draft (the attention sums as for output tokens).
                tokens: &tokens[s][..start + len],
                start,
                len,
                block_table: &tables[s],
                samples: true,
                draft,
                params: &params,
                num_output_tokens: if draft > 0 || start > 0 { len } else { 0 },
            })
            .collect()
    };
    // Every sequence's context, computed once; the timed steps rewrite the positions after it.
    for s in 0..max_batch {
        let one = slices(max_batch, 0, context, 0);
        backend.execute(&one[s..s + 1]).unwrap();
    }
    let mut times = vec![vec![Vec::new(); sizes.len()]; batches.len()];
    for _ in 0..rounds {
        for (b, &batch) in batches.iter().enumerate() {
            for (i, &n) in sizes.iter().enumerate() {
                let step = slices(batch, context, n, n - 1);
                let started = Instant::now();
                backend.execute(&step).unwrap();
                times[b][i].push(started.elapsed().as_secs_f64());
            }
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!(
        "kvgate cpu backend, SmolLM2-135M-Instruct Q4_1, {threads} thread(s), isa {}, context {context}, median of {rounds}",
        backend.isa().name()
    );
    println!(
        "cost of an n-token step per request, relative to the {}-token step of the same batch",
        sizes[0]
    );
    print!("| requests | {}-token step ms |", sizes[0]);
    for n in &sizes[1..] {
        print!(" n={n} |");
    }
    println!();
    println!("|---:|---:|{}", "---:|".repeat(sizes.len() - 1));
    for (b, &batch) in batches.iter().enumerate() {
        let base = median(&mut times[b][0]);
        print!("| {batch} | {:.2} |", base * 1e3);
        for t in &mut times[b][1..] {
            print!(" {:.2} |", median(t) / base);
        }
        println!();
    }
}
