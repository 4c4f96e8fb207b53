//! What the simulator's tests share: a small fleet's settings, and every router's run.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvgate_bench::Load;
use kvgate_sim::{simulate, Outcome, Policy, SimConfig};
use kvgate_worker::backend::profile::Profile;
use std::path::Path;

/// `replicas` replicas of 2,048 blocks of 16 tokens (H200 profile) behind `gateways`
/// gateways, with no delays but the agents' reports.
pub fn config(replicas: usize, gateways: usize) -> SimConfig {
    let profile = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../config/profiles/h200-llama-3.1-8b-bf16.yaml");
    SimConfig {
        replicas,
        gateways,
        profile: Profile::load(&profile).unwrap(),
        num_blocks: Some(2_048),
        block_size: 16,
        max_model_len: 8_192,
        report_interval_ms: 100,
        report_delay_ms: 5,
        model: "m".into(),
        seed: 7,
        warmup: 0,
        time_scale: 1.0,
        gateway_delay_us: 0,
        gateway_jitter_us: 0,
        jitter_seed: 0,
        answers_round_trip: true,
        sample_interval_ms: 100,
        exchange_delay_ms: None,
        speculation: None,
        offload_bytes: 0,
        prefill_replicas: 0,
        pd_min_prompt_tokens: 0,
    }
}

/// Every router's run on the same arrivals, under its name.
pub fn every_run(
    fleet: &SimConfig,
    jobs: &[kvgate_bench::Job],
    load: Load,
) -> Vec<(String, Outcome)> {
    kvgate_sim::NAMES
        .iter()
        .filter_map(|name| match Policy::named(name).unwrap() {
            Policy::Route(router) => Some((name, router)),
            Policy::Oracle => None,
        })
        .map(|(name, router)| {
            let o = simulate(fleet, jobs, load, &router).unwrap();
            assert_eq!(
                o.records.len(),
                jobs.iter().map(|j| j.turns.len()).sum::<usize>(),
                "{name}"
            );
            (name.to_string(), o)
        })
        .collect()
}
