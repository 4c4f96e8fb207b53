//! `kvgate sim` flags, and the run of each policy on the same arrivals.

use crate::bench_cli::{LoadArgs, WorkloadArgs};
use crate::spec_cli::SpecArgs;
use clap::Args;
use kvgate_bench::Summary;
use kvgate_sim::{simulate_with_progress, Outcome, Policy, Progress, Router, SimConfig};
use kvgate_worker::backend::profile::Profile;
use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

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
    /// Each replica's host offload tier, in MiB (0: none): evicted prefix blocks are kept
    /// there and copied back over the profile's `hardware.host_link_gb_s`.
    #[arg(long, default_value_t = 0)]
    kv_offload_mib: usize,
    /// Prefill/decode disaggregation: the first this many replicas prefill, the rest decode
    /// (each gateway routes both legs with kvgate's policy, vLLM's hand-over; the blocks
    /// travel over the profile's `hardware.host_link_gb_s`). 0: colocated.
    #[arg(long, default_value_t = 0)]
    prefill_replicas: usize,
    /// With --prefill-replicas: prompts shorter than this go to a decode replica whole.
    #[arg(long, default_value_t = 0, requires = "prefill_replicas")]
    pd_min_prompt_tokens: usize,
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    #[arg(long, default_value_t = 32_768)]
    max_model_len: usize,
    /// How often each agent reports, and how long its report takes to reach the gateways (each
    /// at most an hour).
    #[arg(long, default_value_t = 100)]
    report_interval_ms: u64,
    #[arg(long, default_value_t = 5)]
    report_delay_ms: u64,
    /// Each modelled step takes this many times longer, as with `kvgate worker --time-scale`:
    /// to compare with a real sim fleet slowed so (times are then in its units).
    #[arg(long, default_value_t = 1.0)]
    worker_time_scale: f64,
    /// Time a request takes from its client through the gateway to its replica, outside the
    /// engines (a gateway's own latency, the network): in every TTFT and, in a closed loop,
    /// in every turn.
    #[arg(long, default_value_t = 0.0)]
    gateway_delay_ms: f64,
    /// Plus a uniform draw in [0, this) per request, from --jitter-seed: the timing noise of
    /// real processes (seeds of it give a run's spread on the same workload).
    #[arg(long, default_value_t = 0.0)]
    gateway_jitter_ms: f64,
    #[arg(long, default_value_t = 0)]
    jitter_seed: u64,
    /// Gateways tell each other where they send each request (kvgate's policies: the prefix
    /// and session the others then assume there) and the prefill they have queued on each
    /// replica, arriving after this many ms (at most an hour); default: they do not.
    #[arg(long)]
    gateway_exchange_ms: Option<u64>,
    /// A turn's answer comes back in the next turn as other tokens than those generated (as
    /// with `kvgate worker --backend sim`, whose random tokens do not survive detokenizing and
    /// tokenizing again), so only the previous prompt's blocks are reused. Default: a real
    /// model's answers, which do.
    #[arg(long)]
    answers_retokenize: bool,
    /// Speculative decoding in every replica's engine, as `kvgate worker --backend sim` takes
    /// it: `--spec-method sim --spec-acceptance F` models a workload whose drafts keep F of
    /// their tokens; ngram and suffix draft on the sim model's tokens.
    #[command(flatten)]
    spec: SpecArgs,
    #[command(flatten)]
    workload: WorkloadArgs,
    #[command(flatten)]
    load: LoadArgs,
    /// The first requests sent, left out of the figures (as `kvgate bench --warmup`).
    #[arg(long, default_value_t = 0)]
    warmup: usize,
    /// A policy to run, repeat to compare on the same arrivals: kvgate (the default preset),
    /// a preset (balanced, cache-first, latency-first), a policy YAML file (a gateway config's
    /// `policy:` section, or one with the section's fields at the top), or a peer's algorithm
    /// (round-robin, least-load, sglang-cache-aware, vllm-consistent-hash, llm-d, dynamo), or
    /// soonest-first-token (each request where its first token comes soonest, knowing every
    /// engine), or the oracle (the best routing its search finds, run after the others).
    #[arg(long = "policy", required = true)]
    policies: Vec<String>,
    /// Replays the oracle's search may run per figure after its starts (every other policy and
    /// preset), at most 10,000.
    #[arg(long, default_value_t = 32)]
    oracle_replays: usize,
    /// Each replica's load and KV use is sampled this often for replicas.csv and the plots
    /// (default: 100 ms, and 100 ms more per 64 replicas, to bound the file; at most an hour).
    #[arg(long)]
    sample_ms: Option<u64>,
    /// No progress line.
    #[arg(long)]
    quiet: bool,
    /// Results: DIR/POLICY/ with summary.json, requests.csv and plots as `kvgate bench` writes
    /// them, and replicas.csv, replica_load.svg and replica_kv.svg.
    #[arg(long)]
    out: PathBuf,
}

/// Replicas at most: each is a whole engine with its own block pool.
const MAX_REPLICAS: usize = 4_096;
/// Gateways at most: each keeps its own view of every replica.
const MAX_GATEWAYS: usize = 256;
/// What a run may take in memory. Its KV blocks dominate: measured, 2.3 GiB for 1,024 replicas
/// of 8,192 blocks (~300 bytes a block, its engine's pool and the run's bookkeeping), and each
/// gateway's index adds at most an entry (~40 bytes) per block cached.
const MAX_RUN_BYTES: usize = 8 << 30;
const BYTES_PER_BLOCK: usize = 300;
const BYTES_PER_INDEX_ENTRY: usize = 40;
/// Tokens per KV block at most.
const MAX_BLOCK_SIZE: usize = 1_024;
/// Report, exchange and sample intervals at most, in ms (an hour).
const MAX_INTERVAL_MS: u64 = 3_600_000;
/// Where the run's floor is written, beside the policies' results.
const FLOOR_DIR: &str = "floor";
/// The oracle's replays per figure at most: each is a whole run.
const MAX_ORACLE_REPLAYS: usize = 10_000;
/// KV blocks fleet-wide at most with the look-ahead: each of its decisions copies every
/// replica's engine, pool included (64 replicas of the default profile's ~53k blocks fit).
const ORACLE_MAX_FLEET_BLOCKS: usize = 4 << 20;

pub fn run(args: SimArgs) -> Result<(), String> {
    let workload = args.workload.workload(args.load.requests)?;
    let mut policies = policies(&args.policies)?;
    // The oracle starts from every other policy's routes.
    policies.sort_by_key(|(_, p)| *p == Policy::Oracle);
    if args.replicas == 0 || args.replicas > MAX_REPLICAS {
        return Err(format!(
            "--replicas must be between 1 and {MAX_REPLICAS}, got {}",
            args.replicas
        ));
    }
    if args.gateways == 0 || args.gateways > MAX_GATEWAYS {
        return Err(format!(
            "--gateways must be between 1 and {MAX_GATEWAYS}, got {}",
            args.gateways
        ));
    }
    let load = args.load.load(&workload)?;
    if !(args.worker_time_scale.is_finite() && args.worker_time_scale > 0.0) {
        return Err(format!(
            "--worker-time-scale must be a positive number, got {}",
            args.worker_time_scale
        ));
    }
    // Whole milliseconds become microseconds of virtual time: bounded, so none overflows.
    for (flag, ms) in [
        ("--report-interval-ms", Some(args.report_interval_ms)),
        ("--report-delay-ms", Some(args.report_delay_ms)),
        ("--gateway-exchange-ms", args.gateway_exchange_ms),
        ("--sample-ms", args.sample_ms),
    ] {
        if let Some(ms) = ms.filter(|&ms| ms > MAX_INTERVAL_MS) {
            return Err(format!(
                "{flag} must be between 0 and {MAX_INTERVAL_MS}, got {ms}"
            ));
        }
    }
    if args.oracle_replays > MAX_ORACLE_REPLAYS {
        return Err(format!(
            "--oracle-replays must be at most {MAX_ORACLE_REPLAYS}, got {}",
            args.oracle_replays
        ));
    }
    for (flag, ms) in [
        ("--gateway-delay-ms", args.gateway_delay_ms),
        ("--gateway-jitter-ms", args.gateway_jitter_ms),
    ] {
        if !(ms.is_finite() && (0.0..=60_000.0).contains(&ms)) {
            return Err(format!("{flag} must be between 0 and 60000, got {ms}"));
        }
    }
    if !(1..=MAX_BLOCK_SIZE).contains(&args.block_size) || args.max_model_len == 0 {
        return Err(format!(
            "--block-size must be between 1 and {MAX_BLOCK_SIZE} and --max-model-len at least 1, got {} and {}",
            args.block_size, args.max_model_len
        ));
    }
    let profile = Profile::load(&args.profile)?;
    let blocks = args
        .num_blocks
        .unwrap_or(profile.kv_capacity_tokens() / args.block_size.max(1));
    let fleet_blocks = blocks.saturating_mul(args.replicas);
    let looks_ahead =
        |p: &Policy| matches!(p, Policy::Oracle | Policy::Route(Router::SoonestFirstToken));
    if fleet_blocks > ORACLE_MAX_FLEET_BLOCKS && policies.iter().any(|(_, p)| looks_ahead(p)) {
        return Err(format!(
            "the look-ahead (soonest-first-token, and the oracle, which starts from it) copies every replica's engine for each request: {fleet_blocks} KV blocks fleet-wide is more than the {ORACLE_MAX_FLEET_BLOCKS} it takes; lower --replicas or --num-blocks"
        ));
    }
    let bytes =
        fleet_blocks.saturating_mul(BYTES_PER_BLOCK + BYTES_PER_INDEX_ENTRY * args.gateways);
    if bytes > MAX_RUN_BYTES {
        return Err(format!(
            "{} replicas of {blocks} KV blocks each, indexed by {} gateways, would take about {:.1} GiB, more than the {} GiB a run may take; lower --replicas, --num-blocks or --gateways",
            args.replicas,
            args.gateways,
            bytes as f64 / f64::from(1u32 << 30),
            MAX_RUN_BYTES >> 30
        ));
    }
    let config = SimConfig {
        replicas: args.replicas,
        gateways: args.gateways,
        profile,
        num_blocks: args.num_blocks,
        block_size: args.block_size,
        max_model_len: args.max_model_len,
        report_interval_ms: args.report_interval_ms,
        report_delay_ms: args.report_delay_ms,
        model: "sim".into(),
        seed: args.load.seed,
        warmup: args.warmup,
        time_scale: args.worker_time_scale,
        gateway_delay_us: (args.gateway_delay_ms * 1e3) as u64,
        gateway_jitter_us: (args.gateway_jitter_ms * 1e3) as u64,
        jitter_seed: args.jitter_seed,
        exchange_delay_ms: args.gateway_exchange_ms,
        answers_round_trip: !args.answers_retokenize,
        sample_interval_ms: args
            .sample_ms
            .unwrap_or(100 * args.replicas.div_ceil(64) as u64),
        speculation: args.spec.config()?,
        offload_bytes: args.kv_offload_mib.checked_mul(1 << 20).ok_or_else(|| {
            format!(
                "--kv-offload-mib {} is more than this machine can name",
                args.kv_offload_mib
            )
        })?,
        prefill_replicas: args.prefill_replicas,
        pd_min_prompt_tokens: args.pd_min_prompt_tokens,
    };
    config.check()?;
    let kvgate_only = |(_, p): &(String, Policy)| matches!(p, Policy::Route(Router::Kvgate(_)));
    if args.prefill_replicas > 0 && !policies.iter().all(kvgate_only) {
        return Err("a disaggregated fleet (--prefill-replicas) is routed by kvgate's policies only (a preset or a policy file)".into());
    }
    let jobs = workload.jobs(args.load.requests, args.load.seed)?;
    let ideal = workload.ideal_cached_ratio(&jobs, args.warmup);
    let show_progress = !args.quiet && std::io::stderr().is_terminal();
    let run_one = |name: &str, router: &Router| -> Result<(Outcome, f64), String> {
        let started = Instant::now();
        let mut bar = ProgressBar::new(name, show_progress);
        let outcome = simulate_with_progress(&config, &jobs, load, router, &mut |p| bar.show(p))?;
        bar.clear();
        Ok((outcome, started.elapsed().as_secs_f64()))
    };
    println!("| policy | requests | P50 TTFT ms | P90 TTFT ms | P50 TPOT ms | cached ratio | max/min per replica | simulated s | wall s | events/s |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let mut results: Vec<(String, Summary)> = Vec::new();
    let mut outcomes: Vec<(String, Outcome)> = Vec::new();
    // The routers those runs used: a start is skipped only where the same router ran (a
    // policy file may be named like a peer).
    let mut ran: Vec<Router> = Vec::new();
    let mut searched = Vec::new();
    let mut floor: Option<(String, Summary)> = None;
    let mut below_floor = Vec::new();
    for (name, policy) in &policies {
        let labels = BTreeMap::from([
            ("policy".to_string(), name.clone()),
            ("workload".to_string(), workload.name()),
            ("replicas".to_string(), args.replicas.to_string()),
            ("gateways".to_string(), config.gateways.to_string()),
            ("simulated".to_string(), "true".to_string()),
        ]);
        let summarize = |outcome: &Outcome, labels: BTreeMap<String, String>| {
            kvgate_bench::summarize(&outcome.records, Default::default(), ideal, labels)
        };
        let dir = args.out.join(name);
        let (summary, outcome, wall) = match policy {
            Policy::Route(router) => {
                let (outcome, wall) = run_one(name, router)?;
                (summarize(&outcome, labels), outcome, wall)
            }
            Policy::Oracle => {
                let started = Instant::now();
                // The oracle runs last: the others' runs are its starts, not needed again.
                let mut starts = std::mem::take(&mut outcomes);
                let names: Vec<&str> = starts.iter().map(|(n, _)| n.as_str()).collect();
                for (start, router) in oracle_starts(&ran, &names)? {
                    let outcome = run_one(&start, &router)?.0;
                    starts.push((start, outcome));
                }
                let starts = kvgate_sim::Starts::new(starts)?;
                for figure in kvgate_sim::FIGURES {
                    let mut bar = ProgressBar::new(name, show_progress);
                    let found = kvgate_sim::search_oracle(
                        &config,
                        &jobs,
                        load,
                        &starts,
                        figure,
                        args.oracle_replays,
                        &mut |p| bar.show(p),
                    )?;
                    bar.clear();
                    let summary = summarize(&found.outcome, labels.clone());
                    write(&dir.join(figure.name()), &summary, &found.outcome)?;
                    below_floor.extend(floor_broken(name, &found.outcome));
                    searched.push((found, summary));
                }
                let (summary, outcome) = oracle_summary(&searched, labels)?;
                (summary, outcome, started.elapsed().as_secs_f64())
            }
        };
        write(&dir, &summary, &outcome)?;
        below_floor.extend(floor_broken(name, &outcome));
        if floor.is_none() {
            let records = kvgate_sim::floor_records(&outcome.records, &outcome.floors_us);
            let mut labels = summary.labels.clone();
            labels.insert("policy".into(), "floor".into());
            labels.insert("floor_of".into(), name.clone());
            let summary = kvgate_bench::summarize(&records, Default::default(), ideal, labels);
            kvgate_bench::write_results(&args.out.join(FLOOR_DIR), &summary, &records)?;
            floor = Some((name.clone(), summary));
        }
        println!(
            "| {name} | {} | {:.1} | {:.1} | {:.2} | {:.3} | {:.2} | {:.2} | {wall:.2} | {:.0} |",
            summary.requests,
            summary.ttft_s.p50 * 1e3,
            summary.ttft_s.p90 * 1e3,
            summary.tpot_s.p50 * 1e3,
            summary.cached_token_ratio,
            summary.replica_imbalance,
            outcome.simulated_s,
            outcome.events as f64 / wall.max(1e-9),
        );
        results.push((name.clone(), summary));
        if let Policy::Route(router) = policy {
            outcomes.push((name.clone(), outcome));
            ran.push(router.clone());
        }
    }
    if let Some(ideal) = ideal {
        println!("\nideal cached ratio (one replica, unbounded cache): {ideal:.3}");
    }
    for (s, _) in &searched {
        println!(
            "oracle's {} TTFT: from {}'s routes, {} of {} replays kept (oracle/{}/)",
            s.figure.name(),
            s.start,
            s.kept,
            s.replays,
            s.figure.name()
        );
    }
    if let Some((of, s)) = &floor {
        println!(
            "floor (each request alone on an idle replica holding every block sent before it): P50 {:.1} ms, P90 {:.1} ms over {}'s requests (floor/)",
            s.ttft_s.p50 * 1e3,
            s.ttft_s.p90 * 1e3,
            of
        );
        match below_floor.is_empty() {
            true => println!("floor holds: no request's TTFT is below its floor in any run"),
            false => println!("FLOOR BROKEN: {}", below_floor.join("; ")),
        }
    }
    match kvgate_sim::oracle_bound(&results) {
        Some(Ok(())) => {
            println!("oracle bound holds: no policy's mean, P50 or P90 TTFT is below the oracle's")
        }
        Some(Err(beaten)) => println!("ORACLE BOUND BROKEN: {}", beaten.join("; ")),
        None => {}
    }
    println!("results in {}", args.out.display());
    Ok(())
}

/// How `name`'s run broke the floor, if it did: how many requests, and the first.
fn floor_broken(name: &str, outcome: &Outcome) -> Option<String> {
    let below = kvgate_sim::below_floor(&outcome.records, &outcome.floors_us);
    let first = below.first()?;
    Some(format!("{name}: {} requests, {first}", below.len()))
}

/// A run's results, as `kvgate bench` writes them, with its replicas' timeline.
fn write(dir: &Path, summary: &Summary, outcome: &Outcome) -> Result<(), String> {
    kvgate_bench::write_results(dir, summary, &outcome.records)?;
    outcome.timeline.write(dir)
}

/// The oracle's figures: each TTFT figure from the routing searched for it, everything else
/// (and requests.csv) from the P90 one's.
fn oracle_summary(
    searched: &[(kvgate_sim::Searched, Summary)],
    mut labels: BTreeMap<String, String>,
) -> Result<(Summary, Outcome), String> {
    let (p90, base) = searched
        .iter()
        .find(|(s, _)| s.figure == kvgate_sim::Figure::P90)
        .ok_or("the oracle's P90 search did not run")?;
    labels.insert(
        "ttft_s".into(),
        "each figure from the oracle's routing for it: oracle/mean, oracle/p50, oracle/p90".into(),
    );
    let mut summary = base.clone();
    summary.labels.extend(labels);
    for (s, figure_summary) in searched {
        match s.figure {
            kvgate_sim::Figure::Mean => summary.ttft_s.mean = figure_summary.ttft_s.mean,
            kvgate_sim::Figure::P50 => summary.ttft_s.p50 = figure_summary.ttft_s.p50,
            kvgate_sim::Figure::P90 => summary.ttft_s.p90 = figure_summary.ttft_s.p90,
        }
    }
    Ok((summary, p90.outcome.clone()))
}

/// What the oracle starts from besides the run's own policies (those routers `ran`, under
/// `names`): every router and preset they are not, so that it is a bound on each whichever of
/// them a run names; one whose name a policy file took is renamed.
fn oracle_starts(ran: &[Router], names: &[&str]) -> Result<Vec<(String, Router)>, String> {
    let mut starts = Vec::new();
    for name in kvgate_sim::NAMES {
        if let Policy::Route(router) = Policy::named(name)? {
            starts.push((name.to_string(), router));
        }
    }
    for preset in kvgate_router::config::preset_names() {
        let router = Router::Kvgate(Box::new(kvgate_router::config::preset(preset)?));
        // `balanced` is the default `kvgate` already starts from.
        if !starts.iter().any(|(_, r)| *r == router) {
            starts.push((preset.to_string(), router));
        }
    }
    Ok(starts
        .into_iter()
        .filter(|(_, router)| !ran.contains(router))
        .map(|(name, router)| {
            if names.contains(&name.as_str()) {
                (format!("{name} (built in)"), router)
            } else {
                (name, router)
            }
        })
        .collect())
}

/// Each `--policy` as (its results directory, its policy), checked before anything runs.
fn policies(policies: &[String]) -> Result<Vec<(String, Policy)>, String> {
    let mut named: Vec<(String, Policy)> = Vec::new();
    for policy in policies {
        let (name, p) = parse_policy(policy)?;
        if name == FLOOR_DIR {
            return Err(format!(
                "--policy {policy}: `{FLOOR_DIR}` names the run's floor (DIR/{FLOOR_DIR}/); rename the file"
            ));
        }
        if named.iter().any(|(n, _)| *n == name) {
            return Err(format!(
                "--policy {policy}: a second policy named `{name}` (each writes DIR/{name}/)"
            ));
        }
        named.push((name, p));
    }
    Ok(named)
}

fn parse_policy(policy: &str) -> Result<(String, Policy), String> {
    let path = Path::new(policy);
    if policy.ends_with(".yaml") || policy.ends_with(".yml") || path.is_file() {
        let config = kvgate_router::config::load_policy_file(path).map_err(|errors| {
            let lines: Vec<String> = errors.iter().map(|e| format!("{policy}: {e}")).collect();
            lines.join("\n")
        })?;
        let name = path
            .file_stem()
            .map_or_else(|| policy.to_string(), |s| s.to_string_lossy().into_owned());
        return Ok((name, Policy::Route(Router::Kvgate(Box::new(config)))));
    }
    let presets = kvgate_router::config::preset_names();
    if presets.contains(&policy) {
        let config = kvgate_router::config::preset(policy)?;
        return Ok((
            policy.to_string(),
            Policy::Route(Router::Kvgate(Box::new(config))),
        ));
    }
    Policy::named(policy)
        .map(|p| (policy.to_string(), p))
        .map_err(|_| {
            format!(
                "unknown policy `{policy}` (known: {}; the presets {}; or a policy YAML file)",
                kvgate_sim::NAMES.join(", "),
                presets.join(", ")
            )
        })
}

/// A one-line progress bar on a terminal, redrawn at most every 200 ms.
struct ProgressBar<'a> {
    name: &'a str,
    on: bool,
    started: Instant,
    drawn: Option<Instant>,
}

impl<'a> ProgressBar<'a> {
    fn new(name: &'a str, on: bool) -> Self {
        ProgressBar {
            name,
            on,
            started: Instant::now(),
            drawn: None,
        }
    }

    fn show(&mut self, p: Progress) {
        let now = Instant::now();
        if !self.on
            || now.duration_since(self.started) < Duration::from_secs(1)
            || self
                .drawn
                .is_some_and(|d| now.duration_since(d) < Duration::from_millis(200))
        {
            return;
        }
        self.drawn = Some(now);
        let done = p.jobs_done as f64 / p.jobs.max(1) as f64;
        let width = 30;
        let filled = (done * width as f64) as usize;
        let wall = now.duration_since(self.started).as_secs_f64();
        eprint!(
            "\r{} [{}{}] {:>3.0}% {} of {} jobs, {:.1} s simulated ({:.1}x real time)  ",
            self.name,
            "#".repeat(filled),
            " ".repeat(width - filled.min(width)),
            done * 100.0,
            p.jobs_done,
            p.jobs,
            p.simulated_s,
            p.simulated_s / wall.max(1e-9),
        );
        let _ = std::io::stderr().flush();
    }

    fn clear(&self) {
        if self.drawn.is_some() {
            eprint!("\r{}\r", " ".repeat(100));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oracle_starts_from_every_router_the_run_did_not_run() {
        let all = oracle_starts(&[], &[]).unwrap();
        assert!(all
            .iter()
            .any(|(n, r)| n == "round-robin" && *r == Router::RoundRobin));
        assert!(all.iter().any(|(n, _)| n == "cache-first"));
        let routers: Vec<&Router> = all.iter().map(|(_, r)| r).collect();
        assert!(
            routers
                .iter()
                .enumerate()
                .all(|(i, r)| !routers[..i].contains(r)),
            "each router once"
        );
        // The run's own round-robin is not run again.
        let rest = oracle_starts(&[Router::RoundRobin], &["round-robin"]).unwrap();
        assert_eq!(rest.len(), all.len() - 1);
        assert!(!rest.iter().any(|(_, r)| *r == Router::RoundRobin));
        // A policy file named round-robin does not stand in for it.
        let file = Router::Kvgate(Box::new(
            kvgate_router::config::preset("cache-first").unwrap(),
        ));
        let named = oracle_starts(std::slice::from_ref(&file), &["round-robin"]).unwrap();
        assert!(named
            .iter()
            .any(|(n, r)| n == "round-robin (built in)" && *r == Router::RoundRobin));
        assert!(!named.iter().any(|(_, r)| *r == file));
    }
}
