//! The `kvgate` command line: thin wrappers around the crates.

mod bench_cli;
mod disagg_cli;
mod keys;
mod sim_cli;
mod spec_cli;
mod step_bench;
mod up;
mod worker_cli;

use clap::{Parser, Subcommand};
use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Mutex, PoisonError};

#[cfg(not(target_env = "msvc"))]
#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[derive(Parser)]
#[command(
    name = "kvgate",
    version,
    about = "KV-cache- and prefix-aware inference gateway for LLM fleets"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Load-test an OpenAI-compatible server (a gateway or an engine) with token-level metrics.
    Bench(bench_cli::BenchArgs),
    /// Simulate a fleet in virtual time (real engines on the sim backend, real gateway
    /// policy) and compare routing policies on the same arrivals.
    Sim(sim_cli::SimArgs),
    /// Time the CUDA backend's steps directly: greedy decode at several batch sizes, sampled
    /// decode at one, and one long prompt (a build with `--features cuda`).
    StepBench(step_bench::StepBenchArgs),
    /// Run the gateway (SIGHUP reloads the config; SIGINT stops at once, SIGTERM gracefully).
    Gateway {
        #[arg(long)]
        config: PathBuf,
        /// Overrides the config's `listen`.
        #[arg(long)]
        listen: Option<String>,
        /// Take over the listening sockets of the running gateway with the same listeners
        /// (then send it SIGQUIT: it hands them over and drains).
        #[arg(long)]
        upgrade: bool,
    },
    /// Run the per-GPU agent: supervise a worker (the command after `--`) or attach to a
    /// running engine, and push its telemetry to every gateway (SIGTERM stops it and the
    /// worker gracefully).
    Agent {
        /// A gateway's admin URL (`http://HOST:PORT`); repeat for several gateways.
        #[arg(long = "gateway", required = true)]
        gateways: Vec<String>,
        /// File holding the bearer token the gateways expect.
        #[arg(long)]
        token_file: PathBuf,
        /// CA certificates (PEM) that `https://` gateways' certificates are checked against
        /// (default: the system's).
        #[arg(long)]
        ca_file: Option<PathBuf>,
        /// The engine's base URL, as the gateways should route to it.
        #[arg(long)]
        url: String,
        /// The replica's name in the fleet (default: its URL).
        #[arg(long)]
        replica_id: Option<String>,
        /// `kvgate`, `vllm`, `sglang` or `llamacpp`.
        #[arg(long, default_value = "kvgate")]
        engine: String,
        /// Milliseconds between reports.
        #[arg(long, default_value_t = 100)]
        interval_ms: u64,
        /// First restart delay of the supervised worker, in ms (doubling to 30 s).
        #[arg(long, default_value_t = 500)]
        restart_backoff_ms: u64,
        /// A GPU (NVML index) whose figures go into reports; repeat for several. Default:
        /// every GPU the driver shows (none without an NVIDIA driver).
        #[arg(long = "gpu")]
        gpus: Vec<u32>,
        /// The worker command to supervise; none to attach to `--url`.
        #[arg(last = true)]
        command: Vec<String>,
    },
    /// Run a local fleet: a gateway and N workers, each under an agent (workers join the
    /// fleet by reporting). Ctrl-C stops it all.
    Up {
        #[arg(long, default_value_t = 2)]
        workers: usize,
        #[arg(long, value_enum, default_value = "cpu")]
        backend: Backend,
        /// The gateway's port (its admin API listens on the next one unless set).
        #[arg(long, default_value_t = 8080)]
        port: u16,
        #[arg(long)]
        admin_port: Option<u16>,
        /// Worker `i` listens on this port plus `i`.
        #[arg(long, default_value_t = 9001)]
        first_worker_port: u16,
        /// CPU backend: threads per worker.
        #[arg(long, default_value_t = 1)]
        threads: usize,
        #[arg(long, default_value = DEFAULT_MODEL)]
        model: PathBuf,
        #[arg(long, default_value = "smollm2")]
        served_model_name: String,
        /// Each worker's offload tier, in MiB (as `kvgate worker`'s).
        #[arg(long, default_value_t = 0)]
        kv_offload_mib: usize,
        /// Prefill/decode disaggregation: the first this many workers `--role prefill`, the
        /// rest `--role decode`, and the gateway's pool hands every prompt from one to the
        /// other (vLLM's flow). 0: every worker serves requests whole.
        #[arg(long, default_value_t = 0)]
        prefill_workers: usize,
        #[command(flatten)]
        spec: spec_cli::SpecArgs,
    },
    /// Run an inference worker: the engine behind an OpenAI-compatible server.
    Worker {
        /// `cpu`: the model computed here; `cuda`: the model on an NVIDIA GPU (a build with
        /// `--features cuda`); `sim`: GPU timing from a hardware profile and deterministic
        /// tokens.
        #[arg(long, value_enum, default_value = "cpu")]
        backend: Backend,
        /// CPU backend: threads for the matrix products.
        #[arg(long, default_value_t = 1)]
        threads: usize,
        /// CUDA backend: the device, counted from 0.
        #[arg(long, default_value_t = 0)]
        gpu: usize,
        /// CUDA backend: the share of the device's memory this worker may use (weights, KV
        /// cache and step buffers), as vLLM's flag of the same name.
        #[arg(long, default_value_t = 0.9)]
        gpu_memory_utilization: f64,
        /// CPU backend: memory for the KV cache, in MiB.
        #[arg(long, default_value_t = 512)]
        kv_cache_mib: usize,
        /// Host memory, in MiB, for prefix blocks evicted from the KV cache: a prefix found
        /// there is loaded back instead of computed again (0: none kept; the sim backend
        /// prices the copies by its profile's hardware.host_link_gb_s).
        #[arg(long, default_value_t = 0)]
        kv_offload_mib: usize,
        /// A directory for a disk tier below the host tier: blocks the host tier evicts are
        /// written there, one file each (the worker locks it and empties it of block files at
        /// start; needs --kv-offload-mib).
        #[arg(long)]
        kv_offload_dir: Option<PathBuf>,
        /// The disk tier's size, in MiB.
        #[arg(long, default_value_t = 4096, requires = "kv_offload_dir")]
        kv_offload_disk_mib: usize,
        #[arg(long, default_value = "127.0.0.1")]
        host: std::net::IpAddr,
        #[arg(long)]
        port: u16,
        /// GGUF model file (the tokenizer and chat template come from it).
        #[arg(long, default_value = DEFAULT_MODEL)]
        model: PathBuf,
        /// Model name in the API (default: the file name without extension).
        #[arg(long)]
        served_model_name: Option<String>,
        /// Sim backend: hardware/model profile.
        #[arg(long, default_value = "config/profiles/h200-llama-3.1-8b-bf16.yaml")]
        profile: PathBuf,
        /// Sim backend: every modelled duration is multiplied by this (> 1 slows down).
        #[arg(long, default_value_t = 1.0)]
        time_scale: f64,
        #[arg(long, default_value_t = 16)]
        block_size: usize,
        /// KV blocks (default: what the backend has room for).
        #[arg(long)]
        num_blocks: Option<usize>,
        /// Context length (default: the model's).
        #[arg(long)]
        max_model_len: Option<usize>,
        #[arg(long, default_value_t = 2048)]
        max_num_batched_tokens: usize,
        #[arg(long, default_value_t = 256)]
        max_num_seqs: usize,
        /// Cap on prompt tokens one request computes per step (0: no cap).
        #[arg(long, default_value_t = 0)]
        long_prefill_token_threshold: usize,
        #[arg(long)]
        no_prefix_caching: bool,
        /// Sim backend: LoRA adapter names resident from the start (comma-separated).
        #[arg(long, value_delimiter = ',')]
        lora_adapters: Vec<String>,
        /// Sim backend: more adapter names, loaded on first use.
        #[arg(long, value_delimiter = ',')]
        lora_catalog: Vec<String>,
        /// Sim backend: adapters resident at once (default: as many as --lora-adapters, plus
        /// one when there is a catalog).
        #[arg(long)]
        max_loras: Option<usize>,
        #[command(flatten)]
        spec: spec_cli::SpecArgs,
        #[command(flatten)]
        disagg: disagg_cli::DisaggArgs,
        #[command(flatten)]
        deadlines: worker_cli::DeadlineArgs,
    },
    /// Validate a gateway config file and report every error with its YAML path.
    CheckConfig { file: PathBuf },
    /// Print the hash of the API key on standard input, for a tenant's `api_keys`.
    HashKey {
        /// Make a new random key: printed first, its hash second.
        #[arg(long)]
        generate: bool,
    },
    /// Run a fault-injection OpenAI-compatible worker (for testing the gateway; it echoes the
    /// prompt instead of running a model).
    FaultWorker {
        #[arg(long, default_value = "127.0.0.1")]
        host: std::net::IpAddr,
        #[arg(long)]
        port: u16,
        /// Replica id reported in `x-worker-id` (default: `worker-PORT`).
        #[arg(long)]
        id: Option<String>,
        #[arg(long, default_value = "test-model")]
        model: String,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        #[arg(long, default_value_t = 0)]
        first_token_delay_ms: u64,
        #[arg(long, default_value_t = 0)]
        token_delay_ms: u64,
        #[arg(long, default_value_t = 0.0)]
        error_rate: f64,
        #[arg(long, default_value_t = 503)]
        error_status: u16,
        #[arg(long, default_value_t = 0.0)]
        hang_rate: f64,
        #[arg(long, default_value_t = 0.0)]
        disconnect_rate: f64,
        #[arg(long, default_value_t = 2)]
        disconnect_after: u32,
        /// Share of requests answered 200 with an event stream that is not an OpenAI one.
        #[arg(long, default_value_t = 0.0)]
        garbage_rate: f64,
        /// Start each streamed token chunk with `: sent_ns=N` (an SSE comment: the wall clock
        /// in nanoseconds when it was sent), to measure a proxy's delay per chunk.
        #[arg(long)]
        stamp_chunks: bool,
    },
}

pub const DEFAULT_MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

#[derive(Clone, Copy, clap::ValueEnum)]
enum Backend {
    Cpu,
    Sim,
    Cuda,
}

/// Log lines waiting for stderr; past this they are dropped.
const LOG_QUEUE_LINES: usize = 64 * 1024;

/// Held for the whole run: dropping it writes out the queued log lines.
static LOG_FLUSH: Mutex<Option<tracing_appender::non_blocking::WorkerGuard>> = Mutex::new(None);

/// Logs to stderr through a bounded queue and a writer thread, so that a stderr nobody
/// drains (a full pipe, a stuck log shipper, a slow disk) costs log lines, never a stalled
/// proxy or engine thread.
fn start_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("KVGATE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let (writer, guard) = tracing_appender::non_blocking::NonBlockingBuilder::default()
        .lossy(true)
        .buffered_lines_limit(LOG_QUEUE_LINES)
        .thread_name("kvgate-log")
        .finish(std::io::stderr());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(writer)
        .init();
    *LOG_FLUSH.lock().unwrap_or_else(PoisonError::into_inner) = Some(guard);
}

/// Writes out the queued log lines (at most a second's wait for a stalled stderr).
fn flush_logs() {
    drop(
        LOG_FLUSH
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take(),
    );
}

fn main() -> ExitCode {
    start_logging();
    let code = main_logged();
    flush_logs();
    code
}

fn main_logged() -> ExitCode {
    if let Err(message) = kvgate_agent::lineage::stop_with_parent() {
        eprintln!("kvgate: {message}");
        return ExitCode::FAILURE;
    }
    // A gateway or worker serves as many connections as it has descriptors for.
    kvgate_router::raise_open_file_limit();
    match run(Cli::parse().command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("kvgate: {message}");
            ExitCode::FAILURE
        }
    }
}

fn run(command: Command) -> Result<(), String> {
    match command {
        Command::Bench(args) => {
            let config = args.into_config()?;
            let out = config.out.clone();
            let summary = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .map_err(|e| format!("runtime: {e}"))?
                .block_on(kvgate_bench::run(config))?;
            print!("{}", kvgate_bench::table(&summary));
            println!("results in {}", out.display());
            Ok(())
        }
        Command::Sim(args) => sim_cli::run(args),
        Command::StepBench(args) => step_bench::run(args),
        Command::HashKey { generate } => keys::hash_key(generate),
        Command::Gateway {
            config,
            listen,
            upgrade,
        } => kvgate_router::run(
            &config,
            kvgate_router::RunOptions {
                listen,
                upgrade,
                before_exit: Some(flush_logs),
            },
        )
        .map_err(|e| e.to_string()),
        Command::Agent {
            gateways,
            token_file,
            ca_file,
            url,
            replica_id,
            engine,
            interval_ms,
            restart_backoff_ms,
            gpus,
            command,
        } => {
            let token = std::fs::read_to_string(&token_file)
                .map_err(|e| format!("token file {}: {e}", token_file.display()))?
                .trim()
                .to_string();
            if interval_ms == 0 {
                return Err("--interval-ms must be at least 1".into());
            }
            if let Some(ca) = &ca_file {
                kvgate_agent::http::trust(ca)?;
            }
            let config = kvgate_agent::AgentConfig {
                gateways,
                token,
                replica: replica_id,
                url: url.trim_end_matches('/').to_string(),
                engine,
                command,
                interval: std::time::Duration::from_millis(interval_ms),
                backoff: kvgate_agent::supervisor::Backoff {
                    first: std::time::Duration::from_millis(restart_backoff_ms.max(1)),
                    ..Default::default()
                },
                gpus: (!gpus.is_empty()).then_some(gpus),
            };
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .map_err(|e| format!("runtime: {e}"))?
                .block_on(kvgate_agent::run(config))
        }
        Command::Up {
            workers,
            backend,
            port,
            admin_port,
            first_worker_port,
            threads,
            model,
            served_model_name,
            kv_offload_mib,
            prefill_workers,
            spec,
        } => {
            // Checked here, so that a bad flag is one error rather than one per worker.
            spec.config()?;
            let mut worker_args = spec.to_args();
            if kv_offload_mib > 0 {
                worker_args.extend(["--kv-offload-mib".into(), kv_offload_mib.to_string()]);
            }
            if !model.exists() {
                return Err(format!(
                    "model file {} not found (scripts/fetch-model fetches the default)",
                    model.display()
                ));
            }
            up::run(up::UpConfig {
                workers,
                backend: match backend {
                    Backend::Cpu => "cpu".into(),
                    Backend::Sim => "sim".into(),
                    Backend::Cuda => "cuda".into(),
                },
                port,
                admin_port: admin_port.unwrap_or(port.wrapping_add(1)),
                first_worker_port,
                threads: threads.max(1),
                model,
                served_model_name,
                worker_args,
                prefill_workers,
            })
        }
        Command::Worker {
            backend,
            threads,
            gpu,
            gpu_memory_utilization,
            kv_cache_mib,
            kv_offload_mib,
            kv_offload_dir,
            kv_offload_disk_mib,
            host,
            port,
            model,
            served_model_name,
            profile,
            time_scale,
            block_size,
            num_blocks,
            max_model_len,
            max_num_batched_tokens,
            max_num_seqs,
            long_prefill_token_threshold,
            no_prefix_caching,
            lora_adapters,
            lora_catalog,
            max_loras,
            spec,
            disagg,
            deadlines,
        } => {
            let speculation = spec.config()?;
            let (disagg, kv_offload_mib) = disagg.config(host, kv_offload_mib)?;
            let slots =
                max_loras.unwrap_or(lora_adapters.len() + usize::from(!lora_catalog.is_empty()));
            let adapters = kvgate_worker::server::adapters::AdapterSet::new(
                lora_adapters,
                lora_catalog,
                slots,
            )?;
            if !model.exists() {
                return Err(format!(
                    "model file {} not found (scripts/fetch-model fetches the default)",
                    model.display()
                ));
            }
            if !(time_scale.is_finite() && time_scale > 0.0) {
                return Err(format!(
                    "--time-scale must be a positive number, got {time_scale}"
                ));
            }
            if block_size == 0 || max_num_batched_tokens == 0 || max_num_seqs == 0 {
                return Err(
                    "--block-size, --max-num-batched-tokens and --max-num-seqs must be at least 1"
                        .into(),
                );
            }
            kvgate_worker::server::run(kvgate_worker::server::WorkerConfig {
                addr: SocketAddr::new(host, port),
                model,
                served_model_name,
                backend: match backend {
                    Backend::Sim => kvgate_worker::server::BackendChoice::Sim {
                        profile,
                        time_scale,
                    },
                    Backend::Cpu => kvgate_worker::server::BackendChoice::Cpu {
                        threads: threads.max(1),
                        kv_cache_bytes: kv_cache_mib << 20,
                    },
                    Backend::Cuda => kvgate_worker::server::BackendChoice::Cuda {
                        gpu,
                        memory_utilization: gpu_memory_utilization,
                    },
                },
                block_size,
                num_blocks,
                max_model_len,
                scheduler: kvgate_worker::sched::SchedulerConfig {
                    max_num_batched_tokens,
                    max_num_seqs,
                    long_prefill_token_threshold,
                    policy: kvgate_worker::sched::SchedulingPolicy::Fcfs,
                },
                prefix_caching: !no_prefix_caching,
                adapters,
                speculation,
                offload_bytes: worker_cli::mib_to_bytes("--kv-offload-mib", kv_offload_mib)?,
                disk_tier: match kv_offload_dir {
                    Some(dir) => Some((
                        dir,
                        worker_cli::mib_to_bytes("--kv-offload-disk-mib", kv_offload_disk_mib)?,
                    )),
                    None => None,
                },
                disagg,
                deadlines: deadlines.deadlines()?,
            })
        }
        Command::CheckConfig { file } => match kvgate_router::check_config(&file) {
            Ok(checked) => {
                for warning in &checked.warnings {
                    println!("{}: warning: {warning}", file.display());
                }
                println!(
                    "{}: ok ({} replicas)",
                    file.display(),
                    checked.config.replicas.len()
                );
                Ok(())
            }
            Err(errors) => {
                for e in &errors {
                    println!("{}: {e}", file.display());
                }
                Err(format!("{}: {} error(s)", file.display(), errors.len()))
            }
        },
        Command::FaultWorker {
            host,
            port,
            id,
            model,
            seed,
            first_token_delay_ms,
            token_delay_ms,
            error_rate,
            error_status,
            hang_rate,
            disconnect_rate,
            disconnect_after,
            garbage_rate,
            stamp_chunks,
        } => {
            let faults = kvgate_testkit::Faults {
                first_token_delay_ms,
                token_delay_ms,
                error_rate,
                error_status,
                hang_rate,
                disconnect_rate,
                disconnect_after,
                garbage_rate,
                healthy: true,
            };
            let config = kvgate_testkit::WorkerConfig {
                addr: SocketAddr::new(host, port),
                id: id.unwrap_or_else(|| format!("worker-{port}")),
                model,
                seed,
                faults,
                stamp_chunks,
            };
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .map_err(|e| e.to_string())?;
            runtime
                .block_on(kvgate_testkit::serve(config))
                .map_err(|e| e.to_string())
        }
    }
}
