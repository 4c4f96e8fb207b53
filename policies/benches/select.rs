//! One routing decision at 8, 64 and 1024 replicas, with 1M prefix chunks indexed; and one
//! on a 64 KB prompt (256 chunks) that every replica holds, as one long system prompt spread
//! over the whole fleet at high load leaves it (and token mode's alike: 4,096 tokens).
//! Run: `cargo bench -p kvgate-policies --bench select`
// Benchmarks are not request paths: failing loudly is what they should do.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
mod fleet;

use fleet::{
    held_everywhere, long_prompt, prompt, setup, token_prompt, CHUNKS_PER_PROMPT, INDEXED_CHUNKS,
};
use kvgate_policies::FleetView;
use kvgate_policies::ReplicaId;
use std::hint::black_box;

fn bench_select(c: &mut Criterion) {
    let mut group = c.benchmark_group("select");
    for replicas in [8u32, 64, 1024] {
        let (policy, fleet, prompts) = setup(replicas);
        assert!(policy.prefix_index().len() >= INDEXED_CHUNKS - CHUNKS_PER_PROMPT);
        let mut i = 0usize;
        group.bench_with_input(
            BenchmarkId::new("warm_prefix", replicas),
            &replicas,
            |b, _| {
                b.iter(|| {
                    i = (i + 7919) % prompts.len();
                    black_box(policy.select_top(&prompts[i], FleetView { replicas: &fleet }, 3))
                })
            },
        );
        let cold = prompt(INDEXED_CHUNKS);
        group.bench_with_input(
            BenchmarkId::new("cold_prefix", replicas),
            &replicas,
            |b, _| {
                b.iter(|| black_box(policy.select_top(&cold, FleetView { replicas: &fleet }, 3)))
            },
        );
        let mut policy = policy;
        let long = long_prompt();
        for r in 0..replicas {
            policy.record(ReplicaId(r), &long);
        }
        group.bench_with_input(
            BenchmarkId::new("long_prefix_everywhere", replicas),
            &replicas,
            |b, _| {
                b.iter(|| black_box(policy.select_top(&long, FleetView { replicas: &fleet }, 3)))
            },
        );
        let blocks = token_prompt(0);
        held_everywhere(&mut policy, replicas, &blocks);
        group.bench_with_input(
            BenchmarkId::new("long_blocks_everywhere", replicas),
            &replicas,
            |b, _| {
                b.iter(|| black_box(policy.select_top(&blocks, FleetView { replicas: &fleet }, 3)))
            },
        );
    }
    group.finish();
}

criterion_group!(benches, bench_select);
criterion_main!(benches);
