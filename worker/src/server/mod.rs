//! The worker's HTTP server (hyper) in front of the engine thread.

pub mod adapters;
pub mod body;
mod choices;
pub mod detok;
pub mod disagg;
mod engine_loop;
mod events;
mod generation;
mod http;
mod metrics;

use crate::backend::cpu::{CpuBackend, CpuConfig};
use crate::backend::profile::Profile;
use crate::backend::sim::SimBackend;
use crate::backend::Backend;
use crate::engine::{Engine, EngineConfig};
use crate::model::ModelFile;
use crate::sched::SchedulerConfig;
use crate::spec::SpecConfig;
use kvgate_protocol::HashSeed;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

/// Commands queued from the HTTP side to the engine thread.
const COMMAND_QUEUE: usize = 4096;
/// KV-event batches retained for replay.
const EVENT_LOG: usize = 65_536;
/// How long requests in flight get to finish after SIGTERM.
const SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(25);
/// How long a stopping worker waits for its engine to finish the step it is in and be
/// dropped (the disk tier removes its files then).
const ENGINE_EXIT_GRACE: std::time::Duration = std::time::Duration::from_secs(5);
/// How long the listener waits after a failed accept before it tries again.
const ACCEPT_RETRY: std::time::Duration = std::time::Duration::from_millis(50);

#[derive(Debug, Clone)]
pub enum BackendChoice {
    Sim {
        profile: PathBuf,
        time_scale: f64,
    },
    Cpu {
        threads: usize,
        kv_cache_bytes: usize,
    },
    Cuda {
        gpu: usize,
        memory_utilization: f64,
    },
}

#[derive(Debug, Clone)]
pub struct WorkerConfig {
    pub addr: SocketAddr,
    pub model: PathBuf,
    pub served_model_name: Option<String>,
    pub backend: BackendChoice,
    pub block_size: usize,
    pub num_blocks: Option<usize>,
    pub max_model_len: Option<usize>,
    pub scheduler: SchedulerConfig,
    pub prefix_caching: bool,
    /// LoRA adapter names served (sim backend only).
    pub adapters: adapters::AdapterSet,
    pub speculation: Option<SpecConfig>,
    /// Bytes of host memory for blocks evicted from the KV cache (0: none kept).
    pub offload_bytes: usize,
    /// A directory and its size in bytes for the disk tier below the host tier.
    pub disk_tier: Option<(std::path::PathBuf, usize)>,
    /// Prefill/decode roles (`None`: colocated).
    pub disagg: Option<disagg::DisaggConfig>,
    pub deadlines: Deadlines,
}

/// How long a client may take over a request's parts before its connection is closed.
#[derive(Debug, Clone, Copy)]
pub struct Deadlines {
    /// The whole header, counted from when the connection awaits one: on a kept-alive
    /// connection from its previous answer (hyper's header timeout), so it is also how long
    /// the connection may sit idle, and must stay above the gateway's `pool_idle_ms` lest the
    /// worker close a connection the gateway's pool is about to reuse.
    pub header: std::time::Duration,
    /// The whole body, from the end of its header: 408.
    pub body: std::time::Duration,
}

#[cfg(feature = "cuda")]
fn cuda_backend(
    config: &WorkerConfig,
    model: &ModelFile,
    gpu: usize,
    memory_utilization: f64,
) -> Result<Box<dyn Backend + Send>, String> {
    let cuda = crate::backend::cuda::CudaConfig {
        gpu,
        memory_utilization,
        block_size: config.block_size,
    };
    let backend = crate::backend::cuda::CudaBackend::load(&config.model, model, &cuda)?;
    tracing::info!(device = backend.describe(), "cuda backend loaded");
    Ok(Box::new(backend))
}

#[cfg(not(feature = "cuda"))]
fn cuda_backend(
    _: &WorkerConfig,
    _: &ModelFile,
    _: usize,
    _: f64,
) -> Result<Box<dyn Backend + Send>, String> {
    Err(crate::backend::cuda::unavailable()
        .unwrap_or("no CUDA backend")
        .into())
}

/// Serves until the process ends.
pub fn run(config: WorkerConfig) -> Result<(), String> {
    let model = Arc::new(
        ModelFile::open(&config.model).map_err(|e| format!("{}: {e}", config.model.display()))?,
    );
    let served_name = config.served_model_name.clone().unwrap_or_else(|| {
        config
            .model
            .file_stem()
            .map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned())
    });
    let (backend, time_scale): (Box<dyn Backend + Send>, f64) = match &config.backend {
        BackendChoice::Sim {
            profile,
            time_scale,
        } => {
            let profile = Profile::load(profile)?;
            let t = &model.prompt.tokenizer;
            (
                Box::new(SimBackend::new(
                    profile,
                    t.first_normal_token(),
                    t.vocab_size(),
                )),
                *time_scale,
            )
        }
        BackendChoice::Cpu {
            threads,
            kv_cache_bytes,
        } => {
            let cpu = CpuConfig {
                threads: *threads,
                kv_cache_bytes: *kv_cache_bytes,
                block_size: config.block_size,
            };
            let backend = CpuBackend::load(&config.model, &model, &cpu)
                .map_err(|e| format!("{}: {e}", config.model.display()))?;
            tracing::info!(isa = backend.isa().name(), threads, "cpu backend loaded");
            (Box::new(backend), 1.0)
        }
        BackendChoice::Cuda {
            gpu,
            memory_utilization,
        } => (
            cuda_backend(&config, &model, *gpu, *memory_utilization)?,
            1.0,
        ),
    };
    if let Some(d) = &config.disagg {
        if d.role.prefills() && !config.prefix_caching {
            return Err(
                "a prefill role serves prompts' blocks from the prefix cache, which is off".into(),
            );
        }
        if d.role.decodes() && config.offload_bytes == 0 {
            return Err(
                "a decode role takes pulled blocks into the host tier: give --kv-offload-mib"
                    .into(),
            );
        }
    }
    let max_model_len = config.max_model_len.unwrap_or(model.params.context_length);
    let eos = model.prompt.tokenizer.eos_token_id.into_iter().collect();
    let engine_config = EngineConfig {
        block_size: config.block_size,
        num_blocks: config.num_blocks,
        max_model_len,
        prefix_caching: config.prefix_caching,
        scheduler: config.scheduler.clone(),
        hash_seed: HashSeed::new(&served_name, None, ""),
        eos_token_ids: eos,
    };
    let shared = Arc::new(engine_loop::Shared {
        stats: Mutex::new(Default::default()),
        events: Mutex::new(events::EventLog::new(EVENT_LOG)),
        metrics: metrics::Metrics::new().map_err(|e| e.to_string())?,
    });
    let (commands, rx) = tokio::sync::mpsc::channel(COMMAND_QUEUE);
    let speculation = config.speculation.clone();
    let offload_bytes = config.offload_bytes;
    let disk_tier = config.disk_tier.clone();
    let engine_thread = engine_loop::spawn(
        move || {
            let mut engine = Engine::new(engine_config, backend).map_err(|e| {
                format!("{e} (flags: --kv-cache-mib or --num-blocks, --max-model-len)")
            })?;
            if offload_bytes > 0 {
                let cost = engine.enable_offload(offload_bytes)?;
                tracing::info!(
                    offload_bytes,
                    load_cost = cost,
                    "offload tier on: a block loaded back costs this share of computing it"
                );
            }
            if let Some((dir, bytes)) = disk_tier {
                let cost = engine.enable_disk_tier(&dir, bytes)?;
                tracing::info!(
                    dir = %dir.display(),
                    bytes,
                    load_cost = cost,
                    "disk tier on: a block read back costs this share of computing it"
                );
            }
            if let Some(spec) = speculation {
                let costs = engine.enable_speculation(spec)?;
                tracing::info!(
                    step_costs = ?costs.points(),
                    "speculative decoding on: step costs by tokens, relative to one"
                );
            }
            Ok(engine)
        },
        time_scale,
        rx,
        Arc::clone(&shared),
    )?;
    if config.adapters.max_loras() > 0 && !matches!(config.backend, BackendChoice::Sim { .. }) {
        return Err("LoRA adapters need adapter weights, which only the sim backend does without (the cpu backend cannot load them yet)".into());
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    // The HTTP port first: a transfer listener on port 0 could otherwise be given it.
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind(config.addr))
        .map_err(|e| format!("cannot listen on {}: {e}", config.addr))?;
    let disagg = match &config.disagg {
        Some(d) => Some(runtime.block_on(disagg::Disagg::start(d, config.offload_bytes))?),
        None => None,
    };
    let ctx = Arc::new(http::Context {
        model,
        served_name,
        adapters: Mutex::new(config.adapters.clone()),
        max_model_len,
        commands,
        shared,
        next_id: AtomicU64::new(1),
        prepare_slots: tokio::sync::Semaphore::new(
            std::thread::available_parallelism().map_or(1, |n| n.get()),
        ),
        disagg,
        body_timeout: config.deadlines.body,
    });
    let result = runtime.block_on(serve(listener, ctx, config.deadlines.header));
    // Ending the runtime drops every task's hold on the engine's command queue: the engine
    // thread then returns and drops the engine.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    join_within(engine_thread, ENGINE_EXIT_GRACE);
    result
}

/// Joins `thread` if it ends within `grace`; else leaves it to the process's exit.
fn join_within(thread: std::thread::JoinHandle<()>, grace: std::time::Duration) {
    let deadline = std::time::Instant::now() + grace;
    while !thread.is_finished() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    if thread.is_finished() {
        let _ = thread.join();
    } else {
        tracing::warn!(grace = ?grace, "the engine is still in a step: exiting without it");
    }
}

async fn serve(
    listener: tokio::net::TcpListener,
    ctx: Arc<http::Context>,
    header_timeout: std::time::Duration,
) -> Result<(), String> {
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    tracing::info!(%addr, model = %ctx.served_name, "kvgate worker listening");
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| format!("cannot listen for SIGTERM: {e}"))?;
    let connections = hyper_util::server::graceful::GracefulShutdown::new();
    let mut http1 = hyper::server::conn::http1::Builder::new();
    http1
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(header_timeout);
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = term.recv() => break,
        };
        let stream = match accepted {
            Ok((s, _)) => s,
            Err(e) => {
                // Out of descriptors, accept fails at once until a connection closes: a
                // pause, not a loop that burns a core and floods the log.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(ACCEPT_RETRY).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let local_ip = stream.local_addr().map_or(addr.ip(), |a| a.ip());
        let ctx = Arc::clone(&ctx);
        let service =
            hyper::service::service_fn(move |req| http::handle(Arc::clone(&ctx), req, local_ip));
        let io = hyper_util::rt::TokioIo::new(stream);
        let connection = connections.watch(http1.serve_connection(io, service));
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "connection ended");
            }
        });
    }
    // New connections are refused from here; requests in flight finish (an agent stopping
    // its worker, or one dying, sends SIGTERM).
    drop(listener);
    tracing::info!("SIGTERM: finishing the requests in flight");
    if tokio::time::timeout(SHUTDOWN_GRACE, connections.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(grace = ?SHUTDOWN_GRACE, "requests still in flight after the grace period");
    }
    Ok(())
}
