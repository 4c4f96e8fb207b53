//! Active health checks and model discovery, and reload on SIGHUP: the gateway's background
//! tasks.

use crate::gateway::Gateway;
use crate::replica::Replica;
use async_trait::async_trait;
use bytes::Bytes;
use kvgate_policies::FailureOutcome;
use kvgate_protocol::openai::ModelList;
use pingora_core::connectors::http::Connector;
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub struct HealthChecker {
    pub gateway: Arc<Gateway>,
}

#[async_trait]
impl BackgroundService for HealthChecker {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut last_discovery: Option<Instant> = None;
        loop {
            let snap = self.gateway.snapshot();
            let health = snap.config.health.clone();
            let discover = last_discovery
                .is_none_or(|t| t.elapsed() >= Duration::from_millis(health.models_refresh_ms));
            let mut checks = tokio::task::JoinSet::new();
            for replica in snap.replicas.iter().filter(|r| !self.gateway.is_ejected(r)) {
                let (gateway, replica, health) = (
                    Arc::clone(&self.gateway),
                    Arc::clone(replica),
                    health.clone(),
                );
                checks.spawn(async move {
                    let timeout = Duration::from_millis(health.timeout_ms);
                    let passed = matches!(
                        get(gateway.connector(), &replica, &health.path, timeout).await,
                        Ok((200..=299, _))
                    );
                    if !passed {
                        tracing::debug!(replica = %replica.name, "health check failed");
                    }
                    if let FailureOutcome::Ejected(backoff_ms) = gateway.replica_checked(&replica, passed, &health) {
                        tracing::warn!(replica = %replica.name, backoff_ms, "replica ejected: health checks failing");
                        gateway.metrics.ejections.with_label_values(&[&replica.name]).inc();
                    }
                    if passed && replica.needs_discovery() && (discover || gateway.models_of(&replica).is_none()) {
                        discover_models(&gateway, &replica, timeout).await;
                    }
                });
            }
            while checks.join_next().await.is_some() {}
            if discover {
                last_discovery = Some(Instant::now());
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(health.interval_ms)) => {}
                _ = shutdown.changed() => return,
            }
        }
    }
}

async fn discover_models(gateway: &Gateway, replica: &Replica, timeout: Duration) {
    match get(gateway.connector(), replica, "/v1/models", timeout).await {
        Ok((200, body)) => match serde_json::from_slice::<ModelList>(&body) {
            Ok(list) => gateway
                .set_discovered_models(replica, list.data.into_iter().map(|m| m.id).collect()),
            Err(e) => tracing::warn!(replica = %replica.name, error = %e, "unreadable /v1/models"),
        },
        Ok((status, _)) => tracing::warn!(replica = %replica.name, status, "/v1/models failed"),
        Err(e) => tracing::debug!(replica = %replica.name, error = %e, "/v1/models unreachable"),
    }
}

/// A GET on a replica within `timeout`: status and body.
async fn get(
    connector: &Connector,
    replica: &Replica,
    path: &str,
    timeout: Duration,
) -> Result<(u16, Bytes), String> {
    crate::client::call(
        connector,
        &replica.upstream,
        "GET",
        path,
        &[],
        None,
        timeout,
    )
    .await
}

/// Reloads the config on SIGHUP.
pub struct ReloadOnSignal {
    pub gateway: Arc<Gateway>,
}

#[async_trait]
impl BackgroundService for ReloadOnSignal {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut hangups = match tokio::signal::unix::signal(
            tokio::signal::unix::SignalKind::hangup(),
        ) {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGHUP; reload through the admin API");
                return;
            }
        };
        loop {
            tokio::select! {
                _ = hangups.recv() => match self.gateway.reload() {
                    Ok(()) => tracing::info!("SIGHUP: configuration reloaded"),
                    Err(errors) => {
                        for e in errors {
                            tracing::error!(error = %e, "SIGHUP: reload rejected; the running config is kept");
                        }
                    }
                },
                _ = shutdown.changed() => return,
            }
        }
    }
}
