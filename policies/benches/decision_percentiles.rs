//! Decision-time percentiles (criterion reports means): times 200,000 single decisions at 8,
//! 64 and 1024 replicas with 1M prefix chunks indexed, half warm prefixes, half cold.
//! Run: `cargo bench -p kvgate-policies --bench decision_percentiles`
// Benchmarks are not request paths: failing loudly is what they should do.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

mod fleet;

use fleet::{prompt, setup, INDEXED_CHUNKS};
use kvgate_policies::FleetView;
use std::hint::black_box;
use std::time::Instant;

const DECISIONS: usize = 200_000;

fn main() {
    println!("| replicas | p50 µs | p99 µs | p99.9 µs |");
    println!("|---:|---:|---:|---:|");
    for replicas in [8u32, 64, 1024] {
        let (policy, fleet, prompts) = setup(replicas);
        let cold: Vec<_> = (0..1000).map(|i| prompt(INDEXED_CHUNKS + i)).collect();
        let mut samples = Vec::with_capacity(DECISIONS);
        for i in 0..DECISIONS {
            let features = if i % 2 == 0 {
                &prompts[(i * 7919) % prompts.len()]
            } else {
                &cold[i % cold.len()]
            };
            let started = Instant::now();
            black_box(policy.select(features, FleetView { replicas: &fleet }));
            samples.push(started.elapsed().as_nanos() as u64);
        }
        samples.sort_unstable();
        let pct = |p: f64| {
            samples[((samples.len() as f64 * p) as usize).min(samples.len() - 1)] as f64 / 1000.0
        };
        println!(
            "| {replicas} | {:.2} | {:.2} | {:.2} |",
            pct(0.50),
            pct(0.99),
            pct(0.999)
        );
    }
}
