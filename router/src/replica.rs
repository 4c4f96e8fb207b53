//! One upstream replica's live state: health, ejection, in-flight count, served models and the
//! scores of its last decision. Shared between requests, the health checker and the admin API,
//! and kept across config reloads while its name stays.

use crate::config::{AgentsConfig, HealthConfig, ReplicaConfig, Upstream};
use kvgate_policies::{Candidate, ReplicaId};
use kvgate_protocol::telemetry::TelemetryReport;
use pingora_core::upstreams::peer::HttpPeer;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

pub struct Replica {
    pub name: String,
    pub slot: ReplicaId,
    pub config: ReplicaConfig,
    pub upstream: Upstream,
    /// Passed its last health check (and not ejected).
    healthy: AtomicBool,
    consecutive_failures: AtomicU32,
    /// Ejections in a row without a healthy check in between: the back-off exponent.
    ejections: AtomicU32,
    /// Milliseconds since `epoch` until which the replica is ejected.
    ejected_until_ms: AtomicU64,
    epoch: Instant,
    in_flight: AtomicU32,
    /// Prompt tokens of its in-flight requests still awaiting their first token, less what
    /// each decision found it holding.
    prefill_backlog: AtomicU64,
    discovered_models: Mutex<Option<Vec<String>>>,
    last_decision: Mutex<Option<Candidate>>,
    agent: Mutex<Option<AgentState>>,
}

/// The latest report from the replica's agent.
#[derive(Debug, Clone)]
struct AgentState {
    report: TelemetryReport,
    received: Instant,
    /// Reports that never arrived (gaps in the sequence numbers).
    missed: u64,
}

/// How current the agent's view of a replica is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Freshness {
    /// No agent reports for it (or agents are off): health checks alone decide.
    NoAgent,
    Fresh,
    /// Older than `stale_after_ms`: scored down.
    Stale,
    /// Older than `exclude_after_ms`, or the worker reported unhealthy: not routed to.
    Excluded,
}

/// An adapter as a replica's agent reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdapterStatus {
    pub resident: bool,
    /// Free adapter slots (`None`: the engine does not say, or serves no adapters).
    pub slots_free: Option<u32>,
}

impl AdapterStatus {
    /// How well the replica suits a request naming the adapter: 1 resident, 0.5 a free slot to
    /// load it into, 0 neither (it would have to evict another adapter).
    pub fn fit(self) -> f64 {
        match (self.resident, self.slots_free) {
            (true, _) => 1.0,
            (false, Some(free)) if free > 0 => 0.5,
            _ => 0.0,
        }
    }
}

/// What a report changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReportOutcome {
    /// The worker process is a new one: what the gateway learnt about its cache is void.
    pub restarted: bool,
    /// Reports missed since the previous one.
    pub missed: u64,
}

/// What a failure did to the replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureOutcome {
    Counted,
    Ejected(Duration),
}

impl Replica {
    pub fn new(slot: ReplicaId, config: ReplicaConfig, upstream: Upstream) -> Self {
        Replica {
            name: config.name().to_string(),
            slot,
            config,
            upstream,
            // Optimistic until the first check: a fresh gateway can serve at once, and a dead
            // replica is found by the first connect failure or check.
            healthy: AtomicBool::new(true),
            consecutive_failures: AtomicU32::new(0),
            ejections: AtomicU32::new(0),
            ejected_until_ms: AtomicU64::new(0),
            epoch: Instant::now(),
            in_flight: AtomicU32::new(0),
            prefill_backlog: AtomicU64::new(0),
            discovered_models: Mutex::new(None),
            last_decision: Mutex::new(None),
            agent: Mutex::new(None),
        }
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Where to connect: TLS for an `https://` replica, its certificate checked for its host.
    pub fn peer(&self, connect: Duration, pool_idle: Option<Duration>) -> HttpPeer {
        let up = &self.upstream;
        let mut peer = HttpPeer::new(up.addr, up.tls, up.host.clone());
        peer.options.connection_timeout = Some(connect);
        peer.options.idle_timeout = pool_idle;
        peer
    }

    /// Eligible for routing: healthy and not ejected.
    pub fn is_available(&self) -> bool {
        self.healthy.load(Ordering::Acquire) && !self.is_ejected()
    }

    pub fn is_ejected(&self) -> bool {
        self.now_ms() < self.ejected_until_ms.load(Ordering::Acquire)
    }

    /// Where the agent's reports stand, given the fleet's agent settings.
    pub fn freshness(&self, agents: Option<&AgentsConfig>) -> Freshness {
        let Some(agents) = agents else {
            return Freshness::NoAgent;
        };
        let agent = self.agent.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(state) = agent.as_ref() else {
            return Freshness::NoAgent;
        };
        let age = state.received.elapsed().as_millis() as u64;
        if !state.report.healthy || age >= agents.exclude_after_ms {
            Freshness::Excluded
        } else if age >= agents.stale_after_ms {
            Freshness::Stale
        } else {
            Freshness::Fresh
        }
    }

    /// Eligible for routing: available, and not excluded by its agent's reports.
    pub fn is_routable(&self, agents: Option<&AgentsConfig>) -> bool {
        self.is_available() && self.freshness(agents) != Freshness::Excluded
    }

    /// Requests its agent last reported queued (0 without reports).
    pub fn reported_waiting(&self) -> u32 {
        self.agent
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .map_or(0, |s| s.report.load.waiting)
    }

    /// Fraction of KV blocks in use its agent last reported (`None` without reports, or when
    /// the engine reports no KV blocks).
    pub fn reported_kv_usage(&self) -> Option<f64> {
        self.agent
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .filter(|s| s.report.load.kv_blocks_total > 0)
            .map(|s| s.report.load.kv_usage())
    }

    /// What its agent last reported about adapter `name` (`None` without reports).
    pub fn adapter_status(&self, name: &str) -> Option<AdapterStatus> {
        self.agent
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .map(|s| AdapterStatus {
                resident: s.report.load.adapters.iter().any(|a| a == name),
                slots_free: s.report.load.adapter_slots_free,
            })
    }

    /// Takes a report from the replica's agent.
    pub fn record_report(&self, report: TelemetryReport) -> ReportOutcome {
        if self.needs_discovery() && !report.load.models.is_empty() {
            self.set_discovered_models(report.load.models.clone());
        }
        let mut agent = self.agent.lock().unwrap_or_else(PoisonError::into_inner);
        let (restarted, gap) = match agent.as_ref() {
            None => (false, 0),
            Some(prev) => (
                prev.report.instance != report.instance,
                report.seq.saturating_sub(prev.report.seq + 1),
            ),
        };
        let missed = agent.as_ref().map_or(0, |p| p.missed) + gap;
        *agent = Some(AgentState {
            report,
            received: Instant::now(),
            missed,
        });
        ReportOutcome {
            restarted,
            missed: gap,
        }
    }

    pub fn in_flight(&self) -> u32 {
        self.in_flight.load(Ordering::Acquire)
    }

    pub fn prefill_backlog(&self) -> u64 {
        self.prefill_backlog.load(Ordering::Acquire)
    }

    fn begin_request(&self, prefill_tokens: u64) {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        self.prefill_backlog
            .fetch_add(prefill_tokens, Ordering::AcqRel);
    }

    fn end_prefill(&self, prefill_tokens: u64) {
        self.prefill_backlog
            .fetch_sub(prefill_tokens, Ordering::AcqRel);
    }

    fn end_request(&self) {
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
    }

    /// A request succeeded: the failure count and the ejection back-off start over. Only a
    /// request can say so: a replica may answer its health checks and fail every request.
    pub fn record_success(&self) {
        self.consecutive_failures.store(0, Ordering::Release);
        self.ejections.store(0, Ordering::Release);
    }

    /// A request or check failed; ejects after `eject_after_failures` in a row, for a back-off
    /// that doubles with each ejection until a request succeeds.
    pub fn record_failure(&self, health: &HealthConfig) -> FailureOutcome {
        let failures = self.consecutive_failures.fetch_add(1, Ordering::AcqRel) + 1;
        if failures < health.eject_after_failures || self.is_ejected() {
            return FailureOutcome::Counted;
        }
        self.consecutive_failures.store(0, Ordering::Release);
        let exponent = self.ejections.fetch_add(1, Ordering::AcqRel).min(16);
        let backoff = health
            .ejection_base_ms
            .saturating_mul(1 << exponent)
            .min(health.ejection_max_ms);
        self.healthy.store(false, Ordering::Release);
        self.ejected_until_ms
            .store(self.now_ms() + backoff, Ordering::Release);
        FailureOutcome::Ejected(Duration::from_millis(backoff))
    }

    /// Result of an active health check. A pass makes the replica eligible again once its
    /// ejection is over, and leaves the failure count and the back-off as they are.
    pub fn record_check(&self, passed: bool, health: &HealthConfig) -> FailureOutcome {
        if passed {
            self.healthy.store(true, Ordering::Release);
            FailureOutcome::Counted
        } else {
            let outcome = self.record_failure(health);
            self.healthy.store(false, Ordering::Release);
            outcome
        }
    }

    /// Models it serves: configured, else discovered; `None` while unknown.
    pub fn models(&self) -> Option<Vec<String>> {
        if !self.config.models.is_empty() {
            return Some(self.config.models.clone());
        }
        self.discovered_models
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    pub fn needs_discovery(&self) -> bool {
        self.config.models.is_empty()
    }

    pub fn set_discovered_models(&self, models: Vec<String>) {
        *self
            .discovered_models
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(models);
    }

    /// Whether it may serve `model`; a replica whose models are unknown is not excluded.
    pub fn may_serve(&self, model: &str) -> ModelMatch {
        match self.models() {
            None => ModelMatch::Unknown,
            Some(models) if models.iter().any(|m| m == model) => ModelMatch::Yes,
            Some(_) => ModelMatch::No,
        }
    }

    pub fn set_last_decision(&self, c: Candidate) {
        *self
            .last_decision
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(c);
    }

    pub fn last_decision(&self) -> Option<Candidate> {
        *self
            .last_decision
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    pub fn status_json(&self, agents: Option<&AgentsConfig>) -> serde_json::Value {
        let agent = self
            .agent
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .map(|s| {
                serde_json::json!({
                    "age_ms": s.received.elapsed().as_millis() as u64,
                    "instance": s.report.instance,
                    "seq": s.report.seq,
                    "missed_reports": s.missed,
                    "healthy": s.report.healthy,
                    "running": s.report.load.running,
                    "waiting": s.report.load.waiting,
                    "kv_blocks_total": s.report.load.kv_blocks_total,
                    "kv_usage": s.report.load.kv_usage(),
                    "adapters": s.report.load.adapters,
                    "gpus": s.report.gpus,
                })
            });
        serde_json::json!({
            "id": self.name,
            "url": self.config.url,
            "healthy": self.healthy.load(Ordering::Acquire),
            "ejected": self.is_ejected(),
            "available": self.is_routable(agents),
            "freshness": self.freshness(agents),
            "agent": agent,
            "in_flight": self.in_flight(),
            "prefill_backlog": self.prefill_backlog(),
            "consecutive_failures": self.consecutive_failures.load(Ordering::Acquire),
            "ejections_in_a_row": self.ejections.load(Ordering::Acquire),
            "models": self.models(),
            "labels": self.config.labels,
            "last_scores": self.last_decision(),
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelMatch {
    Yes,
    No,
    Unknown,
}

/// Holds a replica's in-flight count up for the life of a request, and its prefill backlog
/// until the first token; at the end, wakes the requests waiting for room.
pub struct InFlight {
    replica: Arc<Replica>,
    released: Arc<tokio::sync::Notify>,
    /// Prompt tokens counted in the replica's prefill backlog until the first token.
    prefill_tokens: u64,
}

impl InFlight {
    pub fn new(
        replica: Arc<Replica>,
        released: Arc<tokio::sync::Notify>,
        prefill_tokens: u64,
    ) -> Self {
        replica.begin_request(prefill_tokens);
        InFlight {
            replica,
            released,
            prefill_tokens,
        }
    }

    /// The first token arrived: the prompt is no longer queued prefill.
    pub fn prefilled(&mut self) {
        self.replica
            .end_prefill(std::mem::take(&mut self.prefill_tokens));
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.prefilled();
        self.replica.end_request();
        self.released.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn replica() -> Replica {
        let config = ReplicaConfig {
            url: "http://127.0.0.1:1".into(),
            id: None,
            models: vec![],
            labels: Default::default(),
            max_in_flight: None,
        };
        let upstream = Upstream {
            addr: "127.0.0.1:1".parse().unwrap(),
            authority: "127.0.0.1:1".into(),
            tls: false,
            host: "127.0.0.1".into(),
        };
        Replica::new(ReplicaId(0), config, upstream)
    }

    #[test]
    fn ejects_after_consecutive_failures_with_doubling_backoff() {
        let r = replica();
        let h = HealthConfig {
            eject_after_failures: 2,
            ejection_base_ms: 100,
            ejection_max_ms: 150,
            ..Default::default()
        };
        assert_eq!(r.record_failure(&h), FailureOutcome::Counted);
        r.record_success();
        assert_eq!(r.record_failure(&h), FailureOutcome::Counted);
        assert_eq!(
            r.record_failure(&h),
            FailureOutcome::Ejected(Duration::from_millis(100))
        );
        assert!(!r.is_available());
        r.ejected_until_ms.store(0, Ordering::Release); // back-off over, check still failing
        assert_eq!(r.record_check(false, &h), FailureOutcome::Counted);
        assert_eq!(
            r.record_check(false, &h),
            FailureOutcome::Ejected(Duration::from_millis(150))
        );
        r.ejected_until_ms.store(0, Ordering::Release);
        r.record_check(true, &h);
        assert!(r.is_available());
    }

    #[test]
    fn passing_health_checks_do_not_end_the_back_off_of_failing_requests() {
        let r = replica();
        let h = HealthConfig {
            eject_after_failures: 2,
            ejection_base_ms: 100,
            ejection_max_ms: 10_000,
            ..Default::default()
        };
        // Every request fails while /health keeps answering: each ejection lasts twice the
        // one before.
        for expected in [100, 200, 400, 800] {
            assert_eq!(r.record_failure(&h), FailureOutcome::Counted);
            r.record_check(true, &h);
            assert_eq!(
                r.record_failure(&h),
                FailureOutcome::Ejected(Duration::from_millis(expected))
            );
            r.ejected_until_ms.store(0, Ordering::Release);
            r.record_check(true, &h);
            assert!(r.is_available());
        }
        // A request that succeeds starts the back-off over.
        r.record_success();
        r.record_failure(&h);
        assert_eq!(
            r.record_failure(&h),
            FailureOutcome::Ejected(Duration::from_millis(100))
        );
    }

    #[test]
    fn unknown_models_do_not_exclude() {
        let r = replica();
        assert_eq!(r.may_serve("m"), ModelMatch::Unknown);
        r.set_discovered_models(vec!["m".into()]);
        assert_eq!(r.may_serve("m"), ModelMatch::Yes);
        assert_eq!(r.may_serve("x"), ModelMatch::No);
    }
}
