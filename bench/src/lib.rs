//! `kvgate bench`: an OpenAI-compatible load generator with token-level metrics (vLLM's
//! definitions), for a gateway or a single engine. Workloads: random lengths, shared-prefix
//! groups, multi-turn sessions, Mooncake and Azure trace replay. Load: fixed concurrency, a
//! Poisson rate, or a trace's timestamps. Results: a terminal table, `summary.json`,
//! `requests.csv` and SVG plots, every one labelled.

mod client;
pub mod plot;
mod record;
mod report;
mod rng;
mod run;
mod text;
mod traces;
mod workload;

pub use record::{summarize, RequestRecord, Slo, Stats, Summary};
pub use report::write as write_results;
pub use run::Load;
pub use workload::{Job, Turn, Workload};

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct BenchConfig {
    /// The servers' base URLs (`http://HOST:PORT`); requests take turns over them.
    pub urls: Vec<String>,
    /// The model to ask for (default: the first of `/v1/models`).
    pub model: Option<String>,
    pub workload: Workload,
    pub load: Load,
    /// Requests at most (a trace: its first ones).
    pub requests: usize,
    /// Requests, in sending order, left out of the figures.
    pub warmup: usize,
    pub duration: Option<Duration>,
    pub seed: u64,
    pub slo: Slo,
    /// Sent with every request (e.g. `authorization`, `x-kvgate-class`).
    pub headers: Vec<(String, String)>,
    /// A header that carries each request's prefix group (a shared-prefix group, a session, a
    /// trace's first block).
    pub group_header: Option<String>,
    pub out: PathBuf,
    /// Extra labels (`--label key=value`), beside those the bench adds itself.
    pub labels: BTreeMap<String, String>,
    /// The command line, for the record.
    pub command: String,
    pub progress: bool,
}

/// Runs the benchmark, writes its results to `config.out` and returns the summary.
pub async fn run(config: BenchConfig) -> Result<Summary, String> {
    if config.requests == 0 {
        return Err("--requests must be at least 1".into());
    }
    if config.urls.is_empty() {
        return Err("--url is required".into());
    }
    match config.load {
        Load::Concurrency(0) => return Err("--concurrency must be at least 1".into()),
        Load::Rate(r) if !(r.is_finite() && r > 0.0) => {
            return Err(format!("--rate must be a positive number, got {r}"))
        }
        Load::Replay { speedup } if !(speedup.is_finite() && speedup > 0.0) => {
            return Err(format!(
                "--time-scale must be a positive number, got {speedup}"
            ))
        }
        _ => {}
    }
    let client = client::Client::new(
        &config.urls,
        config.headers.clone(),
        config.group_header.clone(),
    );
    let model = match &config.model {
        Some(m) => m.clone(),
        None => client.first_model().await?,
    };
    let jobs = config.workload.jobs(config.requests, config.seed)?;
    if jobs.is_empty() {
        return Err(format!(
            "workload {} has no requests",
            config.workload.name()
        ));
    }
    let ideal = config.workload.ideal_cached_ratio(&jobs, config.warmup);
    let driver = run::Driver {
        client,
        model: model.clone(),
        warmup: config.warmup,
        duration: config.duration,
        seed: config.seed,
        progress: config.progress,
    };
    let records = driver.run(jobs, config.load).await;
    let labels = labels(&config, &model);
    let summary = record::summarize(&records, config.slo, ideal, labels);
    report::write(&config.out, &summary, &records)?;
    Ok(summary)
}

/// The terminal table of a summary.
pub fn table(summary: &Summary) -> String {
    report::table(summary)
}

fn labels(config: &BenchConfig, model: &str) -> BTreeMap<String, String> {
    let mut l = BTreeMap::new();
    l.insert("model".into(), model.to_string());
    l.insert("url".into(), config.urls.join(","));
    l.insert("workload".into(), config.workload.name());
    l.insert("load".into(), format!("{:?}", config.load));
    l.insert("seed".into(), config.seed.to_string());
    l.insert("bench_version".into(), env!("CARGO_PKG_VERSION").into());
    l.insert("command".into(), config.command.clone());
    l.insert("hardware".into(), hardware());
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    l.insert("unix_time".into(), now.to_string());
    l.extend(config.labels.clone());
    l
}

/// CPU model and count, from /proc/cpuinfo where there is one.
fn hardware() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")?
                .split_once(':')
                .map(|(_, m)| m.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!("{model}, {cpus} CPUs")
}
