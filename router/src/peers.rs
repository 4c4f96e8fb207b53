//! The decision exchange between gateway replicas (`peers:` in the config). Gateways in front
//! of one fleet share no state, so each knows only the prefixes and sessions it placed itself
//! and the prefill it queued itself: N gateways spread a prompt group over up to N replicas,
//! and all pile onto the replica that looks idle to each. Each gateway therefore queues, for
//! every request it routes, the replica it chose with the prompt's leading hashes and its
//! session, and pushes the queue every `interval_ms` to each peer's admin listener
//! (`POST /peer/decisions`, the group's bearer token), with the prefill it has queued on each
//! replica. A peer records the decisions as its own (the prefix assumed held there, the
//! session bound there, the replica's recent traffic counted) and counts the backlog beside its
//! own until the next push replaces it. Bounded and lossy by design: the queue drops its
//! oldest past `max_pending`, a failed push is not retried (the next backlog repairs the last;
//! one unrepeated lapses after [`PEER_BACKLOG_LAPSE_MS`]), and a received decision is not
//! forwarded again, so a slow or dead peer costs nothing but its own agreement.

use crate::config::{GatewayConfig, Upstream};
use crate::gateway::Gateway;
use crate::metrics::Metrics;
use bytes::Bytes;
use kvgate_policies::{ReplicaId, RequestFeatures, PEER_BACKLOG_LAPSE_MS};
use kvgate_protocol::{ApiError, ErrorKind};
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// Where peers push (on the admin listener; not under `/admin/`, it has its own token).
pub const PEER_PATH: &str = "/peer/decisions";
/// Version 2 added the backlog; a version-1 push (decisions only) is still taken.
pub const PEER_VERSION: u32 = 2;
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

/// An id for this gateway process, unlike any other's: its start time and process id hashed.
pub fn new_peer_id() -> u64 {
    let started = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let seed = format!("{started}/{}", std::process::id());
    xxhash_rust::xxh3::xxh3_64(seed.as_bytes())
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

/// The prompt tokens a gateway sent a replica that have not yet produced a first token.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerBacklog {
    pub replica: String,
    pub tokens: u64,
}

/// One push: every decision queued since the last, and the sender's backlog now.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerPush {
    pub version: u32,
    /// The sending gateway, for as long as it runs (its backlog replaces the last it sent).
    #[serde(default)]
    pub gateway: Option<u64>,
    pub decisions: Vec<PeerDecision>,
    /// Replicas it names none for: nothing queued.
    #[serde(default)]
    pub backlog: Vec<PeerBacklog>,
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
    if !(1..=PEER_VERSION).contains(&push.version) {
        return Err(ApiError::new(
            ErrorKind::InvalidRequest,
            format!(
                "push version {} is not supported (this gateway speaks {PEER_VERSION})",
                push.version
            ),
        ));
    }
    let snap = gateway.snapshot();
    // One lookup per name, not a scan of the fleet for each of a push's entries.
    let slots: HashMap<&str, ReplicaId> = snap
        .replicas
        .iter()
        .map(|r| (r.name.as_str(), r.slot))
        .collect();
    let slot = |name: &str| slots.get(name).copied();
    let now = gateway.now_ms();
    let received = push.decisions.len();
    let mut unknown = 0;
    let backlog: Vec<_> = push
        .backlog
        .iter()
        .filter_map(|b| Some((slot(&b.replica)?, b.tokens)))
        .collect();
    let mut fleet = gateway.fleet();
    for decision in push.decisions {
        match slot(&decision.replica) {
            Some(replica) => fleet.peer_sent(replica, &decision.features(now)),
            None => unknown += 1,
        }
    }
    if let Some(peer) = push.gateway {
        fleet.peer_backlog(peer, backlog, now + PEER_BACKLOG_LAPSE_MS);
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
        // The backlog last pushed, and when: a push goes out when there are decisions, when
        // the backlog changed, or to repeat one still standing before peers let it lapse.
        let mut last: (Vec<PeerBacklog>, u64) = (Vec::new(), 0);
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
            let backlog = backlog(gateway, &snap);
            let now = gateway.now_ms();
            let repeat = !backlog.is_empty() && now >= last.1 + PEER_BACKLOG_LAPSE_MS / 4;
            if !decisions.is_empty() || backlog != last.0 || repeat {
                let push = PeerPush {
                    version: PEER_VERSION,
                    gateway: Some(gateway.peer_id),
                    decisions,
                    backlog: backlog.clone(),
                };
                let timeout = Duration::from_millis(peers.timeout_ms);
                push_all(gateway, &resolved, push, timeout).await;
                last = (backlog, now);
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(peers.interval_ms)) => {}
                _ = shutdown.changed() => return,
            }
        }
    }
}

/// This gateway's backlog by replica name, in slot order.
fn backlog(gateway: &Gateway, snap: &crate::snapshot::Snapshot) -> Vec<PeerBacklog> {
    let queued = gateway.fleet().backlogs();
    if queued.is_empty() {
        return Vec::new();
    }
    let names: HashMap<ReplicaId, &str> = snap
        .replicas
        .iter()
        .map(|r| (r.slot, r.name.as_str()))
        .collect();
    queued
        .into_iter()
        .filter_map(|(slot, tokens)| {
            Some(PeerBacklog {
                replica: names.get(&slot)?.to_string(),
                tokens,
            })
        })
        .collect()
}

/// One push to each peer at once, each within `timeout`.
async fn push_all(
    gateway: &Arc<Gateway>,
    peers: &[(String, Result<Upstream, String>)],
    push: PeerPush,
    timeout: Duration,
) {
    let count = push.decisions.len() as u64;
    let body = match serde_json::to_vec(&push) {
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
                    let connector = gateway.connector();
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
