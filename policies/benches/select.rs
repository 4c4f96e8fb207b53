//! One routing decision at 8, 64 and 1024 replicas, with 1M prefix chunks indexed.
//! Run: `cargo bench -p kvgate-policies --bench select`

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kvgate_policies::{FleetView, Policy, PolicyConfig, ReplicaId, ReplicaView, RequestFeatures};
use kvgate_protocol::{text_chunk_hashes, HashSeed};
use std::hint::black_box;

const INDEXED_CHUNKS: usize = 1_000_000;
const CHUNKS_PER_PROMPT: usize = 16;

fn prompt(i: usize) -> RequestFeatures {
    let text = format!("{i:>8}").repeat(CHUNKS_PER_PROMPT * 256 / 8);
    let chunks = text_chunk_hashes(HashSeed::new("bench", None, ""), text.as_bytes(), 256);
    RequestFeatures {
        ring_key: chunks[0],
        prefix_chunks: chunks,
    }
}

fn setup(replicas: u32) -> (Policy, Vec<ReplicaView>, Vec<RequestFeatures>) {
    let config = PolicyConfig {
        prefix_capacity: INDEXED_CHUNKS / replicas as usize + CHUNKS_PER_PROMPT,
        ..PolicyConfig::default()
    };
    let mut policy = Policy::new(config);
    let names: Vec<String> = (0..replicas)
        .map(|i| format!("http://10.0.{}.{}:8000", i / 256, i % 256))
        .collect();
    let members: Vec<(ReplicaId, &str)> = names
        .iter()
        .enumerate()
        .map(|(i, n)| (ReplicaId(i as u32), n.as_str()))
        .collect();
    policy.set_members(&members);
    let prompts: Vec<RequestFeatures> = (0..INDEXED_CHUNKS / CHUNKS_PER_PROMPT)
        .map(prompt)
        .collect();
    for (i, p) in prompts.iter().enumerate() {
        policy.record(ReplicaId(i as u32 % replicas), p);
    }
    let fleet = (0..replicas)
        .map(|i| ReplicaView {
            id: ReplicaId(i),
            healthy: true,
            in_flight: i % 7,
            max_in_flight: None,
        })
        .collect();
    (policy, fleet, prompts)
}

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
                    black_box(policy.select(&prompts[i], FleetView { replicas: &fleet }))
                })
            },
        );
        let cold = prompt(INDEXED_CHUNKS);
        group.bench_with_input(
            BenchmarkId::new("cold_prefix", replicas),
            &replicas,
            |b, _| b.iter(|| black_box(policy.select(&cold, FleetView { replicas: &fleet }))),
        );
    }
    group.finish();
}

criterion_group!(benches, bench_select);
criterion_main!(benches);
