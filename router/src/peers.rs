//! The decision exchange between gateway replicas (`peers:` in the config). Gateways in front
//! of one fleet share no state, so each knows only the prefixes and sessions it placed itself:
//! N gateways spread a prompt group over up to N replicas. Each gateway therefore queues, for
//! every request it routes, the replica it chose with the prompt's leading hashes and its
//! session, and pushes the queue every `interval_ms` to each peer's admin listener
//! (`POST /peer/decisions`, the group's bearer token); a peer records them as its own
//! decisions (the prefix assumed held there, the session bound there, the replica's recent
//! traffic counted) without touching its loads. Bounded and lossy by design: the queue drops
//! its oldest past `max_pending`, a failed push is not retried, and a received decision is not
//! forwarded again, so a slow or dead peer costs nothing but its own agreement.

use crate::config::{GatewayConfig, Upstream};
use crate::gateway::Gateway;
use crate::metrics::Metrics;
use bytes::Bytes;
use kvgate_policies::RequestFeatures;
use kvgate_protocol::{ApiError, ErrorKind};
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// Where peers push (on the admin listener; not under `/admin/`, it has its own token).
pub const PEER_PATH: &str = "/peer/decisions";
pub const PEER_VERSION: u32 = 1;
/// Leading prompt hashes shared per decision (4,096 tokens at 16-token blocks): enough to
/// name a prompt's shared prefix, and a bound on a push's size whatever the prompts' length.
pub const MAX_SHARED_HASHES: usize = 256;

/// The gateways routing to this fleet as far as one knows: itself and its peers.
pub fn group_size(config: &GatewayConfig) -> u32 {
    config
        .peers
        .as_ref()
        .map_or(1, |p| p.urls.len().saturating_add(1) as u32)
}

/// One routing decision as peers learn it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerDecision {
    /// The replica's stable name (`id` in the config): the same in every gateway of a group.
    pub replica: String,
    /// Token mode: the prompt's leading block hashes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub blocks: Vec<u64>,
    /// Text mode: its leading chunk hashes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub chunks: Vec<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<u64>,
}

impl PeerDecision {
    pub fn new(replica: &str, features: &RequestFeatures) -> Self {
        let lead = |h: &[u64]| h[..h.len().min(MAX_SHARED_HASHES)].to_vec();
        PeerDecision {
            replica: replica.to_string(),
            blocks: lead(&features.block_hashes),
            chunks: lead(&features.prefix_chunks),
            session: features.session,
        }
    }

    /// What the policy records for it, by the receiving gateway's clock.
    fn features(self, now_ms: u64) -> RequestFeatures {
        RequestFeatures {
            block_hashes: self.blocks,
            prefix_chunks: self.chunks,
            session: self.session,
            now_ms,
            ..RequestFeatures::default()
        }
    }
}

/// One push: every decision queued since the last.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerPush {
    pub version: u32,
    pub decisions: Vec<PeerDecision>,
}

/// Decisions waiting for the next push.
#[derive(Debug, Default)]
pub struct Outbox {
    pending: Mutex<VecDeque<PeerDecision>>,
}

impl Outbox {
    /// Queues a decision, dropping the oldest to keep at most `max`; counts both.
    pub fn queue(&self, decision: PeerDecision, max: usize, metrics: &Metrics) {
        let count = |outcome: &str| metrics.peer_decisions.with_label_values(&[outcome]).inc();
        count("queued");
        if self.push(decision, max) {
            count("dropped");
        }
    }

    /// Queues a decision; returns whether the oldest was dropped to keep at most `max`.
    fn push(&self, decision: PeerDecision, max: usize) -> bool {
        let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        pending.push_back(decision);
        let dropped = pending.len() > max.max(1);
        if dropped {
            pending.pop_front();
        }
        dropped
    }

    /// Everything queued, oldest first.
    pub fn take(&self) -> Vec<PeerDecision> {
        let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        pending.drain(..).collect()
    }
}

/// Handles one push from a peer; returns the status and JSON body to answer with.
pub fn take_push(gateway: &Gateway, authorization: Option<&[u8]>, body: &[u8]) -> (u16, Vec<u8>) {
    let count = |outcome: &str, n: usize| {
        gateway
            .metrics
            .peer_decisions
            .with_label_values(&[outcome])
            .inc_by(n as u64)
    };
    match accept(gateway, authorization, body) {
        Ok((received, unknown)) => {
            count("received", received);
            count("unknown_replica", unknown);
            (200, br#"{"status":"ok"}"#.to_vec())
        }
        Err(e) => {
            count("rejected", 1);
            (e.kind.status(), e.to_json())
        }
    }
}

/// Records a push's decisions: how many, and how many named a replica this gateway lacks.
fn accept(
    gateway: &Gateway,
    authorization: Option<&[u8]>,
    body: &[u8],
) -> Result<(usize, usize), ApiError> {
    crate::bearer::check(
        gateway.tokens().peer.clone(),
        authorization,
        "the decision exchange is off (the config has no `peers` section)",
        "peers.token_file",
    )?;
    let push: PeerPush = serde_json::from_slice(body)
        .map_err(|e| ApiError::new(ErrorKind::InvalidRequest, format!("bad push: {e}")))?;
    if push.version != PEER_VERSION {
        return Err(ApiError::new(
            ErrorKind::InvalidRequest,
            format!(
                "push version {} is not supported (this gateway speaks {PEER_VERSION})",
                push.version
            ),
        ));
    }
    let snap = gateway.snapshot();
    let now = gateway.now_ms();
    let received = push.decisions.len();
    let mut unknown = 0;
    let mut fleet = gateway.fleet();
    for decision in push.decisions {
        match snap.replicas.iter().find(|r| r.name == decision.replica) {
            Some(replica) => fleet.peer_sent(replica.slot, &decision.features(now)),
            None => unknown += 1,
        }
    }
    Ok((received - unknown, unknown))
}

/// Pushes the queued decisions to every peer, every `interval_ms`.
pub struct Pusher {
    pub gateway: Arc<Gateway>,
}

#[async_trait::async_trait]
impl BackgroundService for Pusher {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let gateway = &self.gateway;
        // The peers' addresses, resolved once per list of URLs (they change on reload only).
        let mut resolved: Vec<(String, Result<Upstream, String>)> = Vec::new();
        loop {
            let snap = gateway.snapshot();
            let Some(peers) = &snap.config.peers else {
                // Off: look again later, in case a reload turned it on.
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(1)) => continue,
                    _ = shutdown.changed() => return,
                }
            };
            if !resolved.iter().map(|(u, _)| u).eq(peers.urls.iter()) {
                resolved = peers
                    .urls
                    .iter()
                    .map(|u| (u.clone(), crate::config::resolve_url(u)))
                    .collect();
            }
            let decisions = gateway.outbox.take();
            if !decisions.is_empty() {
                let timeout = Duration::from_millis(peers.timeout_ms);
                push_all(gateway, &resolved, decisions, timeout).await;
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(peers.interval_ms)) => {}
                _ = shutdown.changed() => return,
            }
        }
    }
}

/// One push of `decisions` to each peer at once, each within `timeout`.
async fn push_all(
    gateway: &Arc<Gateway>,
    peers: &[(String, Result<Upstream, String>)],
    decisions: Vec<PeerDecision>,
    timeout: Duration,
) {
    let count = decisions.len() as u64;
    let body = match serde_json::to_vec(&PeerPush {
        version: PEER_VERSION,
        decisions,
    }) {
        Ok(b) => Bytes::from(b),
        Err(e) => {
            tracing::error!(error = %e, "cannot encode a push to peers");
            return;
        }
    };
    let auth = format!(
        "Bearer {}",
        gateway.tokens().peer.as_deref().unwrap_or_default()
    );
    let mut pushes = tokio::task::JoinSet::new();
    for (url, up) in peers {
        let (gateway, body, auth, url, up) = (
            Arc::clone(gateway),
            body.clone(),
            auth.clone(),
            url.clone(),
            up.clone(),
        );
        pushes.spawn(async move {
            let headers = [
                ("authorization", auth.as_str()),
                ("content-type", "application/json"),
            ];
            let result = match &up {
                Ok(up) => {
                    let connector = &gateway.connector;
                    crate::client::call(
                        connector,
                        up,
                        "POST",
                        PEER_PATH,
                        &headers,
                        Some(body),
                        timeout,
                    )
                    .await
                }
                Err(e) => Err(e.clone()),
            };
            let ok = matches!(result, Ok((200, _)));
            if !ok {
                tracing::debug!(peer = %url, ?result, "push to a peer gateway failed");
            }
            let m = &gateway.metrics;
            let (decisions, push) = if ok {
                ("sent", "ok")
            } else {
                ("lost", "failed")
            };
            m.peer_decisions
                .with_label_values(&[decisions])
                .inc_by(count);
            m.peer_pushes.with_label_values(&[&url, push]).inc();
        });
    }
    while pushes.join_next().await.is_some() {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_decision_shares_only_the_leading_hashes_and_the_session() {
        let features = RequestFeatures {
            block_hashes: (0..1_000).collect(),
            session: Some(7),
            prompt_tokens: 16_000,
            ..RequestFeatures::default()
        };
        let d = PeerDecision::new("worker-a", &features);
        assert_eq!(d.blocks.len(), MAX_SHARED_HASHES);
        assert_eq!(d.blocks[..3], [0, 1, 2]);
        assert!(d.chunks.is_empty());
        let back = d.clone().features(42);
        assert_eq!(back.session, Some(7));
        assert_eq!(back.now_ms, 42);
        assert_eq!(back.block_hashes.len(), MAX_SHARED_HASHES);
        // Empty lists stay off the wire.
        let wire = serde_json::to_string(&d).unwrap();
        assert!(!wire.contains("chunks"), "{wire}");
    }

    #[test]
    fn the_outbox_keeps_the_newest_within_its_bound() {
        let outbox = Outbox::default();
        let d = |name: &str| PeerDecision::new(name, &RequestFeatures::default());
        assert!(!outbox.push(d("a"), 2));
        assert!(!outbox.push(d("b"), 2));
        assert!(outbox.push(d("c"), 2));
        let names: Vec<String> = outbox.take().into_iter().map(|d| d.replica).collect();
        assert_eq!(names, ["b", "c"]);
        assert!(outbox.take().is_empty());
    }
}
