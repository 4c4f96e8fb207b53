//! Decision-time percentiles (criterion reports means): times 200,000 single decisions at 8,
//! 64 and 1024 replicas, half warm prefixes, half cold; in text mode with 1M prefix chunks
//! indexed, then in token mode with 1M blocks known from KV events (each decision there also
//! records its assumed entries, as the gateway does); and in token mode through the whole
//! fleet state, as the gateway decides: candidates, views, ranking and sending, with 64
//! requests kept in flight (each decision ends the request sent 64 before it).
//! Run: `cargo bench -p kvgate-policies --bench decision_percentiles`
// Benchmarks are not request paths: failing loudly is what they should do.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

mod fleet;

use fleet::{
    prompt, setup, setup_fleet_state, setup_precise, token_prompt, INDEXED_BLOCKS, INDEXED_CHUNKS,
};
use kvgate_policies::{Ask, FleetView, RequestFeatures};
use std::hint::black_box;
use std::time::{Duration, Instant};

const DECISIONS: usize = 200_000;

fn main() {
    println!("| mode | replicas | p50 µs | p99 µs | p99.9 µs |");
    println!("|---|---:|---:|---:|---:|");
    for replicas in [8u32, 64, 1024] {
        let (policy, fleet, warm) = setup(replicas);
        let cold: Vec<_> = (0..1000).map(|i| prompt(INDEXED_CHUNKS + i)).collect();
        let samples = time(|i| {
            let f = pick(&warm, &cold, i);
            let started = Instant::now();
            black_box(policy.select_top(f, FleetView { replicas: &fleet }, 3));
            started.elapsed()
        });
        report("text", replicas, samples);
        let (mut precise, fleet, mut warm) = setup_precise(replicas);
        assert!(precise.precise_index().len() >= INDEXED_BLOCKS - 256);
        let mut cold: Vec<_> = (0..1000)
            .map(|i| token_prompt(INDEXED_BLOCKS + i))
            .collect();
        let samples = time(|i| {
            // The gateway's clock advances 1 ms per decision.
            let now_ms = i as u64;
            let f = pick_mut(&mut warm, &mut cold, i);
            f.now_ms = now_ms;
            let started = Instant::now();
            let d = precise.select_top(f, FleetView { replicas: &fleet }, 3);
            precise.record_choice(&d.ranked[0], f);
            started.elapsed()
        });
        report("token", replicas, samples);
        drop(precise);
        let (mut state, mut warm) = setup_fleet_state(replicas);
        let mut cold: Vec<_> = (0..1000)
            .map(|i| token_prompt(INDEXED_BLOCKS + i))
            .collect();
        let any = Default::default();
        let samples = time(|i| {
            let now_ms = i as u64;
            let f = pick_mut(&mut warm, &mut cold, i);
            f.now_ms = now_ms;
            let ask = Ask {
                model: "m",
                pool: &any,
                features: f,
            };
            let started = Instant::now();
            black_box(state.route(i as u64, &ask, now_ms, 3).unwrap());
            state.first_token(i as u64, now_ms);
            state.finished((i as u64).wrapping_sub(64));
            started.elapsed()
        });
        report("token, fleet state", replicas, samples);
    }
}

/// Alternately a warm and a cold prompt.
fn pick<'a>(
    warm: &'a [RequestFeatures],
    cold: &'a [RequestFeatures],
    i: usize,
) -> &'a RequestFeatures {
    if i.is_multiple_of(2) {
        &warm[(i * 7919) % warm.len()]
    } else {
        &cold[i % cold.len()]
    }
}

fn pick_mut<'a>(
    warm: &'a mut [RequestFeatures],
    cold: &'a mut [RequestFeatures],
    i: usize,
) -> &'a mut RequestFeatures {
    if i.is_multiple_of(2) {
        let n = warm.len();
        &mut warm[(i * 7919) % n]
    } else {
        let n = cold.len();
        &mut cold[i % n]
    }
}

fn time(mut decide: impl FnMut(usize) -> Duration) -> Vec<u64> {
    (0..DECISIONS)
        .map(|i| decide(i).as_nanos() as u64)
        .collect()
}

fn report(mode: &str, replicas: u32, mut samples: Vec<u64>) {
    samples.sort_unstable();
    let pct = |p: f64| {
        samples[((samples.len() as f64 * p) as usize).min(samples.len() - 1)] as f64 / 1000.0
    };
    println!(
        "| {mode} | {replicas} | {:.2} | {:.2} | {:.2} |",
        pct(0.50),
        pct(0.99),
        pct(0.999)
    );
}
