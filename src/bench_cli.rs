//! `kvgate bench` flags, turned into a [`kvgate_bench::BenchConfig`].

use clap::Args;
use kvgate_bench::{BenchConfig, Load, Slo, Workload};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Args)]
pub struct BenchArgs {
    /// The server's base URL (a gateway or one engine); repeat it for several gateways in
    /// front of one fleet, which requests then take turns over.
    #[arg(long = "url", required = true)]
    urls: Vec<String>,
    /// Default: the first model of the server's `/v1/models`.
    #[arg(long)]
    model: Option<String>,
    #[command(flatten)]
    workload: WorkloadArgs,
    #[command(flatten)]
    load: LoadArgs,
    /// Stop starting requests after this many seconds.
    #[arg(long)]
    duration_s: Option<f64>,
    /// The first requests sent, left out of the figures.
    #[arg(long, default_value_t = 0)]
    warmup: usize,
    /// Results: summary.json, requests.csv, ttft_cdf.svg, over_time.svg.
    #[arg(long)]
    out: PathBuf,
    /// Goodput objectives, e.g. `ttft=0.5,tpot=0.05,e2e=10` (seconds).
    #[arg(long)]
    slo: Option<String>,
    /// A header for every request, `NAME: VALUE`; repeat for several.
    #[arg(long = "header")]
    headers: Vec<String>,
    /// A header that carries each request's prefix group (shared-prefix group, multi-turn
    /// session, a trace's first block), for routers that hash a header (`x-user-id` for vLLM's
    /// `consistent_hash`).
    #[arg(long)]
    group_header: Option<String>,
    /// A label for the results, `KEY=VALUE`; repeat for several.
    #[arg(long = "label")]
    labels: Vec<String>,
    /// No progress line.
    #[arg(long)]
    quiet: bool,
}

/// How jobs start and how many, as `kvgate bench` and `kvgate sim` take them.
#[derive(Args)]
pub struct LoadArgs {
    /// Jobs in flight at once (closed loop).
    #[arg(long, conflicts_with = "rate")]
    concurrency: Option<usize>,
    /// Jobs started per second, Poisson (open loop). Neither this nor --concurrency: a trace
    /// replays its own timestamps.
    #[arg(long)]
    rate: Option<f64>,
    /// Trace replay speed-up: timestamps are divided by this.
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Requests at most (a trace: its first ones).
    #[arg(long)]
    pub requests: usize,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

impl LoadArgs {
    pub fn load(&self, workload: &Workload) -> Result<Load, String> {
        match (self.concurrency, self.rate) {
            (Some(n), _) => Ok(Load::Concurrency(n)),
            (None, Some(r)) if r.is_finite() && r > 0.0 => Ok(Load::Rate(r)),
            (None, Some(r)) => Err(format!("--rate must be a positive number, got {r}")),
            (None, None) if workload.is_trace() => Ok(Load::Replay {
                speedup: self.time_scale,
            }),
            (None, None) => Err("give --concurrency or --rate (or a trace workload)".into()),
        }
    }
}

/// A workload and its shape, as `kvgate bench` and `kvgate sim` take them.
#[derive(Args)]
pub struct WorkloadArgs {
    /// random | shared-prefix | one-system-prompt (shared-prefix, one group) | multi-turn |
    /// mooncake:FILE | azure:FILE
    #[arg(long)]
    workload: String,
    /// random: mean prompt tokens, and the log-normal shape.
    #[arg(long, default_value_t = 512.0)]
    input_mean: f64,
    #[arg(long, default_value_t = 0.5)]
    input_sigma: f64,
    /// random: mean output tokens, and the log-normal shape.
    #[arg(long, default_value_t = 128.0)]
    output_mean: f64,
    #[arg(long, default_value_t = 0.5)]
    output_sigma: f64,
    /// shared-prefix: groups, prompts per group, system and question tokens.
    #[arg(long, default_value_t = 16)]
    groups: usize,
    #[arg(long, default_value_t = 16)]
    prompts_per_group: usize,
    #[arg(long, default_value_t = 2048)]
    system_len: usize,
    #[arg(long, default_value_t = 128)]
    question_len: usize,
    /// shared-prefix and multi-turn: output tokens per request.
    #[arg(long, default_value_t = 256)]
    output_len: u32,
    /// multi-turn: turns per session, tokens per user turn.
    #[arg(long, default_value_t = 5)]
    turns: usize,
    #[arg(long, default_value_t = 128)]
    turn_len: usize,
    /// mooncake: tokens per hash id block.
    #[arg(long, default_value_t = 512)]
    block_tokens: usize,
}

impl WorkloadArgs {
    /// The workload of `requests` requests.
    pub fn workload(&self, requests: usize) -> Result<Workload, String> {
        Ok(match self.workload.split_once(':') {
            None if self.workload == "random" => Workload::Random {
                input_mean: self.input_mean,
                input_sigma: self.input_sigma,
                output_mean: self.output_mean,
                output_sigma: self.output_sigma,
            },
            None if self.workload == "shared-prefix" => Workload::SharedPrefix {
                groups: self.groups,
                prompts_per_group: self.prompts_per_group,
                system_len: self.system_len,
                question_len: self.question_len,
                output_len: self.output_len,
            },
            None if self.workload == "one-system-prompt" => Workload::SharedPrefix {
                groups: 1,
                prompts_per_group: requests,
                system_len: self.system_len,
                question_len: self.question_len,
                output_len: self.output_len,
            },
            None if self.workload == "multi-turn" => Workload::MultiTurn {
                turns: self.turns,
                system_len: self.system_len,
                turn_len: self.turn_len,
                output_len: self.output_len,
            },
            Some(("mooncake", path)) => Workload::Mooncake {
                path: PathBuf::from(path),
                block_tokens: self.block_tokens,
            },
            Some(("azure", path)) => Workload::Azure {
                path: PathBuf::from(path),
            },
            _ => {
                return Err(format!(
                    "unknown workload `{}` (random, shared-prefix, one-system-prompt, multi-turn, mooncake:FILE, azure:FILE)",
                    self.workload
                ))
            }
        })
    }
}

impl BenchArgs {
    pub fn into_config(self) -> Result<BenchConfig, String> {
        let workload = self.workload.workload(self.load.requests)?;
        let load = self.load.load(&workload)?;
        let headers = self
            .headers
            .iter()
            .map(|h| {
                h.split_once(':')
                    .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
                    .ok_or_else(|| format!("--header `{h}`: expected NAME: VALUE"))
            })
            .collect::<Result<_, _>>()?;
        let labels = self
            .labels
            .iter()
            .map(|l| {
                l.split_once('=')
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .ok_or_else(|| format!("--label `{l}`: expected KEY=VALUE"))
            })
            .collect::<Result<_, _>>()?;
        if let Some(d) = self.duration_s.filter(|d| !(d.is_finite() && *d > 0.0)) {
            return Err(format!("--duration-s must be a positive number, got {d}"));
        }
        Ok(BenchConfig {
            urls: self.urls,
            model: self.model,
            workload,
            load,
            requests: self.load.requests,
            warmup: self.warmup,
            duration: self.duration_s.map(Duration::from_secs_f64),
            seed: self.load.seed,
            slo: parse_slo(self.slo.as_deref())?,
            headers,
            group_header: self.group_header,
            out: self.out,
            labels,
            command: std::env::args().collect::<Vec<_>>().join(" "),
            progress: !self.quiet,
        })
    }
}

fn parse_slo(text: Option<&str>) -> Result<Slo, String> {
    let mut slo = Slo::default();
    for part in text.unwrap_or("").split(',').filter(|p| !p.is_empty()) {
        let (key, value) = part
            .split_once('=')
            .ok_or_else(|| format!("--slo `{part}`: expected KEY=SECONDS"))?;
        let v: f64 = value
            .parse()
            .ok()
            .filter(|v: &f64| v.is_finite() && *v > 0.0)
            .ok_or_else(|| format!("--slo `{part}`: not a positive number of seconds"))?;
        match key {
            "ttft" => slo.ttft_s = Some(v),
            "tpot" => slo.tpot_s = Some(v),
            "e2e" => slo.e2e_s = Some(v),
            other => {
                return Err(format!(
                    "--slo: unknown objective `{other}` (ttft, tpot, e2e)"
                ))
            }
        }
    }
    Ok(slo)
}
