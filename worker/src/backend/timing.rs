//! What a backend's steps and block loads cost, timed on the backend itself before the first
//! request (in blocks the engine has not handed out yet), for speculative decoding and the
//! offload tiers to weigh. Each figure is the best of a few runs, against machine noise.

use super::{Backend, BatchSlice, BlockCosts};
use crate::request::SamplingParams;
use crate::spec::StepCosts;
use std::time::{Duration, Instant};

/// Tokens that are not special in a vocabulary of `vocab`, spread over it.
pub fn filler(len: usize, vocab: usize) -> Vec<u32> {
    let vocab = vocab.max(1) as u32;
    (0..len as u32).map(|i| (i * 7919 + 100) % vocab).collect()
}

/// Verification steps of each size after a short context; linear when the cache has too few
/// blocks or a step fails.
pub fn step_costs<B: Backend + ?Sized>(
    backend: &mut B,
    vocab: usize,
    block_size: usize,
    free_blocks: usize,
    max_tokens: usize,
) -> StepCosts {
    const CONTEXT: usize = 128;
    const RUNS: usize = 2;
    let sizes = StepCosts::sizes_to_measure(max_tokens);
    let total = CONTEXT + sizes.last().copied().unwrap_or(1);
    let blocks = total.div_ceil(block_size.max(1));
    if blocks > free_blocks {
        return StepCosts::linear();
    }
    let tokens = filler(total, vocab);
    let table: Vec<u32> = (1..=blocks as u32).collect();
    let params = SamplingParams::default();
    // The context as a prompt, then steps shaped as the engine's: one output token already
    // sampled, then the draft.
    let prompt = BatchSlice {
        id: 0,
        tokens: &tokens[..CONTEXT],
        start: 0,
        len: CONTEXT,
        block_table: &table,
        samples: false,
        draft: 0,
        params: &params,
        num_output_tokens: 0,
    };
    let step = |len: usize| BatchSlice {
        tokens: &tokens[..CONTEXT + len],
        start: CONTEXT,
        len,
        samples: true,
        draft: len - 1,
        num_output_tokens: len,
        ..prompt
    };
    if backend.execute(&[prompt]).is_err() {
        return StepCosts::linear();
    }
    let mut points = Vec::with_capacity(sizes.len());
    for n in sizes {
        let mut best = Duration::MAX;
        for _ in 0..RUNS {
            let started = Instant::now();
            if backend.execute(&[step(n)]).is_err() {
                return StepCosts::linear();
            }
            best = best.min(started.elapsed());
        }
        points.push((n, best.as_secs_f64()));
    }
    StepCosts::from_points(points).unwrap_or_else(|_| StepCosts::linear())
}

/// A block's tokens computed as a prompt in the first block, against that block exported and
/// imported again; `None` when the backend cannot move K/V.
pub fn block_costs<B: Backend + ?Sized>(
    backend: &mut B,
    vocab: usize,
    block_size: usize,
) -> Option<BlockCosts> {
    const RUNS: usize = 3;
    let tokens = filler(block_size, vocab);
    let params = SamplingParams::default();
    let prompt = BatchSlice {
        id: 0,
        tokens: &tokens,
        start: 0,
        len: tokens.len(),
        block_table: &[1],
        samples: false,
        draft: 0,
        params: &params,
        num_output_tokens: 0,
    };
    let (mut compute, mut load, mut bytes) = (Duration::MAX, Duration::MAX, 0);
    for _ in 0..RUNS {
        let started = Instant::now();
        backend.execute(&[prompt]).ok()?;
        compute = compute.min(started.elapsed());
        let started = Instant::now();
        let data = backend.export_block(1)?;
        bytes = data.len();
        backend.import_block(1, &data).ok()?;
        load = load.min(started.elapsed());
    }
    Some(BlockCosts {
        compute_s: compute.as_secs_f64(),
        load_s: load.as_secs_f64(),
        bytes,
        exports_bytes: true,
    })
}
