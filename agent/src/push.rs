//! The agent's main loop: every interval, check the worker's health, read its telemetry and
//! push a report to every gateway.

use crate::adapter::{self, EngineAdapter, EngineLoad};
use crate::gpu::Gpus;
use crate::http;
use crate::kv_relay::KvRelay;
use crate::supervisor::{self, unix_ms, Backoff};
use kvgate_protocol::telemetry::{
    ReportReply, TelemetryReport, MAX_GATEWAYS, REPORT_PATH, TELEMETRY_VERSION,
};
use std::time::Duration;
use tokio::sync::watch;

#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// Gateway admin URLs (`http://HOST:PORT`) the reports go to.
    pub gateways: Vec<String>,
    /// Bearer token the gateways expect.
    pub token: String,
    /// The replica's name in the fleet (default: `url`).
    pub replica: Option<String>,
    /// The engine's base URL, as the gateways should route to it.
    pub url: String,
    /// `kvgate`, `vllm`, `sglang` or `llamacpp`.
    pub engine: String,
    /// The worker command to supervise; empty to attach to an engine already running.
    pub command: Vec<String>,
    pub interval: Duration,
    /// Restart delays for the supervised worker.
    pub backoff: Backoff,
    /// The GPUs whose NVML figures go into reports (`None`: every GPU the driver shows).
    pub gpus: Option<Vec<u32>>,
}

/// Deadline for one health check, scrape or report.
const CALL_TIMEOUT: Duration = Duration::from_millis(800);

/// Runs the agent until SIGTERM or SIGINT, then stops the supervised worker gracefully.
pub async fn run(config: AgentConfig) -> Result<(), String> {
    let adapter = adapter::for_engine(&config.engine)?;
    if config.gateways.is_empty() {
        return Err("at least one --gateway is needed".into());
    }
    if config.gateways.len() > MAX_GATEWAYS as usize {
        return Err(format!(
            "{} gateways given; an agent reports to at most {MAX_GATEWAYS}",
            config.gateways.len()
        ));
    }
    if config.token.is_empty() {
        return Err("the token is empty".into());
    }
    let (stop_tx, stop_rx) = watch::channel(false);
    let (instance_tx, instance_rx) = watch::channel(unix_ms());
    let supervised = !config.command.is_empty();
    let supervisor = supervised.then(|| {
        tokio::spawn(supervisor::supervise(
            config.command.clone(),
            config.backoff.clone(),
            instance_tx,
            stop_rx.clone(),
        ))
    });
    let pusher = tokio::spawn(push_loop(
        config,
        adapter,
        supervised.then_some(instance_rx),
        stop_rx,
    ));
    shutdown_signal().await;
    tracing::info!("stopping");
    let _ = stop_tx.send(true);
    if let Some(s) = supervisor {
        let _ = s.await;
    }
    let _ = pusher.await;
    Ok(())
}

/// Resolves on SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// Reports every `interval` until `stop`. `instance` comes from the supervisor; attached, a
/// worker that comes back after failing its health check counts as a new instance.
async fn push_loop(
    config: AgentConfig,
    adapter: Box<dyn EngineAdapter>,
    instance: Option<watch::Receiver<u64>>,
    mut stop: watch::Receiver<bool>,
) {
    let replica = config.replica.clone().unwrap_or_else(|| config.url.clone());
    let auth = format!("Bearer {}", config.token);
    let mut ticker = tokio::time::interval(config.interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut seq = 0u64;
    let mut attached_instance = unix_ms();
    let mut was_healthy = true;
    let mut failing: Vec<bool> = vec![false; config.gateways.len()];
    let mut unreadable = false;
    let mut relay = KvRelay::default();
    let gpus = Gpus::open(config.gpus.clone());
    let mut relay_failing = false;
    // Absent for one, so that a single gateway of an earlier release still takes the reports.
    let gateways = (config.gateways.len() > 1).then_some(config.gateways.len() as u32);
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        let healthy = http::get_text(&config.url, "/health", CALL_TIMEOUT)
            .await
            .is_ok();
        if healthy && !was_healthy {
            attached_instance = unix_ms();
        }
        was_healthy = healthy;
        let (healthy, sample) = if healthy {
            let read = read_sample(&config.url, adapter.as_ref()).await;
            // Log changes only, as for the gateways below.
            match (&read, unreadable) {
                (Err(e), false) => tracing::warn!(error = %e, "cannot read the engine's telemetry"),
                (Ok(_), true) => tracing::info!("engine telemetry readable again"),
                _ => {}
            }
            unreadable = read.is_err();
            match read {
                Ok(sample) => (true, sample),
                Err(_) => (false, EngineLoad::default()),
            }
        } else {
            (false, EngineLoad::default())
        };
        let instance = instance.as_ref().map_or(attached_instance, |i| *i.borrow());
        let kv = if healthy && adapter.relays_kv_events() {
            let update = relay.update(&config.url, instance, CALL_TIMEOUT).await;
            match (&update, relay_failing) {
                (Err(e), false) => tracing::warn!(error = %e, "cannot read the worker's KV events"),
                (Ok(_), true) => tracing::info!("KV events readable again"),
                _ => {}
            }
            relay_failing = update.is_err();
            if update.is_err() {
                relay.resync();
            }
            update.ok()
        } else {
            None
        };
        seq += 1;
        let report = TelemetryReport {
            version: TELEMETRY_VERSION,
            replica: replica.clone(),
            url: config.url.clone(),
            instance,
            seq,
            healthy,
            load: sample,
            kv,
            gpus: gpus.sample(),
            gateways,
        };
        let body = serde_json::to_vec(&report).unwrap_or_default();
        // One task per gateway, so that a dead gateway does not delay the others.
        let sends: Vec<_> = config
            .gateways
            .iter()
            .map(|g| {
                let (g, auth, body) = (g.clone(), auth.clone(), body.clone());
                tokio::spawn(async move {
                    let headers = [
                        ("authorization", auth.as_str()),
                        ("content-type", "application/json"),
                    ];
                    match http::request(
                        http::Method::POST,
                        &g,
                        REPORT_PATH,
                        &headers,
                        Some(body),
                        CALL_TIMEOUT,
                    )
                    .await
                    {
                        Ok((200, body)) => Ok(serde_json::from_slice::<ReportReply>(&body)
                            .is_ok_and(|r| r.kv_snapshot)),
                        Ok((status, body)) => Err(format!(
                            "status {status}: {}",
                            String::from_utf8_lossy(&body)
                        )),
                        Err(e) => Err(e.to_string()),
                    }
                })
            })
            .collect();
        for ((gateway, send), failed) in config.gateways.iter().zip(sends).zip(&mut failing) {
            let outcome = send.await.unwrap_or_else(|e| Err(e.to_string()));
            if outcome == Ok(true) {
                tracing::debug!(%gateway, "gateway asks for a KV snapshot");
                relay.resync();
            }
            let error = outcome.err();
            // Log changes only: a gateway that is down would otherwise flood the log.
            match (&error, *failed) {
                (Some(e), false) => tracing::warn!(%gateway, error = %e, "report not accepted"),
                (None, true) => tracing::info!(%gateway, "reports accepted again"),
                _ => {}
            }
            *failed = error.is_some();
        }
    }
}

/// Fetches the adapter's paths and parses them.
async fn read_sample(url: &str, adapter: &dyn EngineAdapter) -> Result<EngineLoad, String> {
    let mut bodies = Vec::new();
    for path in adapter.paths() {
        bodies.push(http::get_text(url, path, CALL_TIMEOUT).await.ok());
    }
    adapter.parse(&bodies)
}
