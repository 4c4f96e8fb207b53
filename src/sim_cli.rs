//! `kvgate sim` flags, and the run of each policy on the same arrivals.

use crate::bench_cli::{LoadArgs, WorkloadArgs};
use clap::Args;
use kvgate_sim::{simulate, Router, SimConfig};
use kvgate_worker::backend::profile::Profile;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Args)]
pub struct SimArgs {
    /// Replicas in the fleet (at most 4,096).
    #[arg(long)]
    replicas: usize,
    /// Gateways, each with its own view of the fleet; jobs are spread over them.
    #[arg(long, default_value_t = 1)]
    gateways: usize,
    /// Each replica's hardware and model profile (the sim backend's).
    #[arg(long, default_value = "config/profiles/h200-llama-3.1-8b-bf16.yaml")]
    profile: PathBuf,
    /// KV blocks per replica (default: what the profile's memory holds).
    #[arg(long)]
    num_blocks: Option<usize>,
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    #[arg(long, default_value_t = 32_768)]
    max_model_len: usize,
    /// How often each agent reports, and how long its report takes to reach the gateways.
    #[arg(long, default_value_t = 100)]
    report_interval_ms: u64,
    #[arg(long, default_value_t = 5)]
    report_delay_ms: u64,
    #[command(flatten)]
    workload: WorkloadArgs,
    #[command(flatten)]
    load: LoadArgs,
    /// A policy to run: kvgate, round-robin, least-load, sglang-cache-aware,
    /// vllm-consistent-hash; repeat to compare
    /// on the same arrivals.
    #[arg(long = "policy", required = true)]
    policies: Vec<String>,
    /// Results: DIR/POLICY/summary.json, requests.csv and plots, as `kvgate bench` writes.
    #[arg(long)]
    out: PathBuf,
}

/// Replicas at most: each is a whole engine with its own block pool.
const MAX_REPLICAS: usize = 4_096;
/// KV blocks fleet-wide at most: each costs its engine's pool entry and every gateway's index
/// entry, so this bounds a run's memory to a few GiB.
const MAX_FLEET_BLOCKS: usize = 16 << 20;

pub fn run(args: SimArgs) -> Result<(), String> {
    let workload = args.workload.workload()?;
    let routers = args
        .policies
        .iter()
        .map(|p| Router::named(p).map(|r| (p.clone(), r)))
        .collect::<Result<Vec<_>, _>>()?;
    if args.replicas == 0 || args.replicas > MAX_REPLICAS {
        return Err(format!(
            "--replicas must be between 1 and {MAX_REPLICAS}, got {}",
            args.replicas
        ));
    }
    let load = args.load.load(&workload)?;
    let profile = Profile::load(&args.profile)?;
    let blocks = args
        .num_blocks
        .unwrap_or(profile.kv_capacity_tokens() / args.block_size.max(1));
    let fleet_blocks = blocks.saturating_mul(args.replicas);
    if fleet_blocks > MAX_FLEET_BLOCKS {
        return Err(format!(
            "{} replicas of {blocks} KV blocks each are {fleet_blocks} blocks, more than the {MAX_FLEET_BLOCKS} a run keeps in memory (measured: ~450 bytes a block with 8 gateways); lower --replicas or --num-blocks",
            args.replicas
        ));
    }
    let config = SimConfig {
        replicas: args.replicas,
        gateways: args.gateways.max(1),
        profile,
        num_blocks: args.num_blocks,
        block_size: args.block_size,
        max_model_len: args.max_model_len,
        report_interval_ms: args.report_interval_ms,
        report_delay_ms: args.report_delay_ms,
        model: "sim".into(),
        seed: args.load.seed,
    };
    let jobs = workload.jobs(args.load.requests, args.load.seed)?;
    println!("| policy | requests | P50 TTFT ms | P90 TTFT ms | cached ratio | simulated s | wall s | events/s |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    for (name, router) in routers {
        let started = Instant::now();
        let outcome = simulate(&config, &jobs, load, &router)?;
        let wall = started.elapsed().as_secs_f64();
        let labels = BTreeMap::from([
            ("policy".to_string(), name.clone()),
            ("workload".to_string(), workload.name()),
            ("replicas".to_string(), args.replicas.to_string()),
            ("gateways".to_string(), config.gateways.to_string()),
            ("simulated".to_string(), "true".to_string()),
        ]);
        let summary = kvgate_bench::summarize(&outcome.records, Default::default(), None, labels);
        kvgate_bench::write_results(&args.out.join(&name), &summary, &outcome.records)?;
        println!(
            "| {name} | {} | {:.1} | {:.1} | {:.3} | {:.2} | {wall:.2} | {:.0} |",
            summary.requests,
            summary.ttft_s.p50 * 1e3,
            summary.ttft_s.p90 * 1e3,
            summary.cached_token_ratio,
            outcome.simulated_s,
            outcome.events as f64 / wall.max(1e-9),
        );
    }
    println!("results in {}", args.out.display());
    Ok(())
}
