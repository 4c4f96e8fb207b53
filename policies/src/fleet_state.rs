//! The fleet as one gateway sees it, with no clock of its own: the replicas and what they serve,
//! the requests in flight on each, their agents' reports, their health, and the routing policy's
//! learnt state (prefix indexes, ring, sessions). It takes timestamped events and answers ranked
//! decisions with their breakdown; the gateway is the I/O shell around it, and the simulator
//! drives the same type in virtual time.

use crate::{
    Applied, Candidate, Decision, FleetView, Policy, PolicyConfig, ReplicaId, ReplicaView,
    RequestFeatures,
};
use kvgate_protocol::telemetry::{EngineLoad, GpuStats, KvUpdate, TelemetryReport};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};

/// A replica as the config (or its agent, when it joined by reporting) describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaSpec {
    /// Its stable name: it places the replica on the ring.
    pub name: String,
    pub url: String,
    /// Models it serves by the config; empty: learnt from its reports or `/v1/models`.
    pub models: Vec<String>,
    pub labels: BTreeMap<String, String>,
    pub max_in_flight: Option<u32>,
}

/// When agents' reports go stale (scored down) and when they exclude a replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReportAges {
    pub stale_after_ms: u64,
    pub exclude_after_ms: u64,
}

/// How current the agent's view of a replica is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
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

/// When consecutive failures eject a replica, and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ejection {
    pub after_failures: u32,
    pub base_ms: u64,
    /// The back-off doubles with each ejection in a row, up to this.
    pub max_ms: u64,
}

/// What a failure did to a replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureOutcome {
    Counted,
    /// Ejected for this many milliseconds.
    Ejected(u64),
}

/// A request's identity while it is in flight (the gateway's request id).
pub type RequestId = u64;

/// What one request asks of the fleet.
#[derive(Debug, Clone, Copy)]
pub struct Ask<'a> {
    pub model: &'a str,
    /// Labels a replica must carry (its SLA class's pool; empty: any).
    pub pool: &'a BTreeMap<String, String>,
    pub features: &'a RequestFeatures,
}

/// Why no replica was ranked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NoRoute {
    #[error("model `{model}` is not served by any replica")]
    UnknownModel { model: String },
    #[error("model `{model}` is not served by any replica in the pool {pool:?}")]
    NotInPool {
        model: String,
        pool: BTreeMap<String, String>,
    },
    #[error("no healthy replica serves model `{model}`")]
    NoneHealthy { model: String },
}

/// The latest report from a replica's agent.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AgentState {
    pub instance: u64,
    pub seq: u64,
    pub healthy: bool,
    pub load: EngineLoad,
    /// Its GPUs as the agent last saw them (for status pages; routing does not read them).
    pub gpus: Vec<GpuStats>,
    pub received_ms: u64,
    /// Reports that never arrived (gaps in the sequence numbers).
    pub missed: u64,
}

/// What a report changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReportOutcome {
    /// The worker process is a new one: what was learnt about its cache is void.
    pub restarted: bool,
    /// Reports missed since the previous one.
    pub missed: u64,
}

/// One replica's live state.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicaState {
    pub spec: ReplicaSpec,
    /// Passed its last health check.
    pub healthy: bool,
    /// Ejected until then.
    pub ejected_until_ms: u64,
    pub consecutive_failures: u32,
    /// Ejections in a row without a successful request in between: the back-off exponent.
    pub ejections: u32,
    pub discovered_models: Option<Vec<String>>,
    pub agent: Option<AgentState>,
    /// Requests in flight on it from this gateway.
    pub in_flight: u32,
    /// Prompt tokens of its in-flight requests still awaiting their first token, less what
    /// each decision found it holding.
    pub prefill_backlog: u64,
    /// The scores of the last request sent to it.
    pub last_decision: Option<Candidate>,
}

impl ReplicaState {
    fn new(spec: ReplicaSpec) -> Self {
        ReplicaState {
            spec,
            // Optimistic until the first check: a fresh gateway can serve at once, and a dead
            // replica is found by the first connect failure or check.
            healthy: true,
            ejected_until_ms: 0,
            consecutive_failures: 0,
            ejections: 0,
            discovered_models: None,
            agent: None,
            in_flight: 0,
            prefill_backlog: 0,
            last_decision: None,
        }
    }

    /// Models it serves: configured, else discovered; `None` while unknown.
    pub fn models(&self) -> Option<&[String]> {
        if self.spec.models.is_empty() {
            self.discovered_models.as_deref()
        } else {
            Some(&self.spec.models)
        }
    }

    pub fn is_ejected(&self, now_ms: u64) -> bool {
        now_ms < self.ejected_until_ms
    }

    pub fn freshness(&self, ages: Option<ReportAges>, now_ms: u64) -> Freshness {
        let (Some(ages), Some(agent)) = (ages, &self.agent) else {
            return Freshness::NoAgent;
        };
        let age = now_ms.saturating_sub(agent.received_ms);
        if !agent.healthy || age >= ages.exclude_after_ms {
            Freshness::Excluded
        } else if age >= ages.stale_after_ms {
            Freshness::Stale
        } else {
            Freshness::Fresh
        }
    }

    /// Healthy, not ejected, and not excluded by its agent's reports.
    pub fn is_routable(&self, ages: Option<ReportAges>, now_ms: u64) -> bool {
        self.healthy
            && !self.is_ejected(now_ms)
            && self.freshness(ages, now_ms) != Freshness::Excluded
    }

    /// Requests its agent last reported queued (0 without reports).
    pub fn reported_waiting(&self) -> u32 {
        self.agent.as_ref().map_or(0, |a| a.load.waiting)
    }

    /// Fraction of KV blocks in use its agent last reported (`None` without reports, or when
    /// the engine reports no KV blocks).
    pub fn reported_kv_usage(&self) -> Option<f64> {
        self.agent
            .as_ref()
            .filter(|a| a.load.kv_blocks_total > 0)
            .map(|a| a.load.kv_usage())
    }

    /// How well it suits a request naming adapter `model`, from its agent's report: `None`
    /// without reports; else whether it is resident and whether a slot is free to load it.
    fn adapter(&self, model: &str) -> Option<AdapterStatus> {
        self.agent.as_ref().map(|a| AdapterStatus {
            resident: a.load.adapters.iter().any(|m| m == model),
            slots_free: a.load.adapter_slots_free,
        })
    }

    fn model_match(&self, model: &str) -> ModelMatch {
        match self.models() {
            None => ModelMatch::Unknown,
            Some(models) if models.iter().any(|m| m == model) => ModelMatch::Yes,
            Some(_) => ModelMatch::No,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ModelMatch {
    Yes,
    No,
    Unknown,
}

/// An adapter as a replica's agent reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct AdapterStatus {
    resident: bool,
    /// Free adapter slots (`None`: the engine does not say, or serves no adapters).
    slots_free: Option<u32>,
}

impl AdapterStatus {
    /// 1 resident, 0.5 a free slot to load it into, 0 neither (it would evict another).
    fn fit(self) -> f64 {
        match (self.resident, self.slots_free) {
            (true, _) => 1.0,
            (false, Some(free)) if free > 0 => 0.5,
            _ => 0.0,
        }
    }

    fn capable(status: Option<Self>) -> bool {
        status.is_some_and(|a| a.slots_free.is_some())
    }
}

/// A request the gateway sent and has not seen end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Sent {
    replica: ReplicaId,
    /// Prompt tokens counted in its replica's prefill backlog until the first token.
    prefill_tokens: u64,
}

/// Replicas by slot: slots are small and dense (the gateway hands them out from 0).
#[derive(Debug, Clone, Default)]
struct Slots(Vec<Option<ReplicaState>>);

impl Slots {
    fn get(&self, id: ReplicaId) -> Option<&ReplicaState> {
        self.0.get(id.0 as usize)?.as_ref()
    }

    fn get_mut(&mut self, id: ReplicaId) -> Option<&mut ReplicaState> {
        self.0.get_mut(id.0 as usize)?.as_mut()
    }

    fn take(&mut self, id: ReplicaId) -> Option<ReplicaState> {
        self.0.get_mut(id.0 as usize)?.take()
    }

    fn put(&mut self, id: ReplicaId, state: ReplicaState) {
        let i = id.0 as usize;
        if self.0.len() <= i {
            self.0.resize_with(i + 1, || None);
        }
        self.0[i] = Some(state);
    }

    fn iter(&self) -> impl Iterator<Item = (ReplicaId, &ReplicaState)> {
        self.0
            .iter()
            .enumerate()
            .filter_map(|(i, r)| Some((ReplicaId(i as u32), r.as_ref()?)))
    }
}

/// The fleet and the policy's learnt state; see the module documentation.
#[derive(Debug, Clone)]
pub struct FleetState {
    policy: Policy,
    ages: Option<ReportAges>,
    replicas: Slots,
    requests: HashMap<RequestId, Sent>,
}

impl FleetState {
    pub fn new(config: PolicyConfig, ages: Option<ReportAges>) -> Self {
        FleetState {
            policy: Policy::new(config),
            ages,
            replicas: Slots::default(),
            requests: HashMap::new(),
        }
    }

    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    pub fn report_ages(&self) -> Option<ReportAges> {
        self.ages
    }

    /// New settings; learnt state is kept where it still applies.
    pub fn set_config(&mut self, config: PolicyConfig, ages: Option<ReportAges>) {
        self.policy.set_config(config);
        self.ages = ages;
    }

    /// The fleet's membership. A replica keeps its state while its slot, name and spec stay;
    /// one whose spec changed starts over (its requests in flight still count), and slots no
    /// longer listed lose everything learnt about them.
    pub fn set_replicas(&mut self, replicas: Vec<(ReplicaId, ReplicaSpec)>) {
        let mut next = Slots::default();
        for (id, spec) in replicas {
            let state = match self.replicas.take(id) {
                Some(old) if old.spec == spec => old,
                Some(old) if old.spec.name == spec.name => ReplicaState {
                    in_flight: old.in_flight,
                    prefill_backlog: old.prefill_backlog,
                    ..ReplicaState::new(spec)
                },
                _ => ReplicaState::new(spec),
            };
            next.put(id, state);
        }
        self.replicas = next;
        let members: Vec<(ReplicaId, &str)> = self
            .replicas
            .iter()
            .map(|(id, r)| (id, r.spec.name.as_str()))
            .collect();
        self.policy.set_members(&members);
    }

    pub fn replica(&self, id: ReplicaId) -> Option<&ReplicaState> {
        self.replicas.get(id)
    }

    pub fn replicas(&self) -> impl Iterator<Item = (ReplicaId, &ReplicaState)> {
        self.replicas.iter()
    }

    /// A request to the replica succeeded: its failure count and ejection back-off start
    /// over. Only a request can say so: a replica may answer its health checks and fail every
    /// request.
    pub fn succeeded(&mut self, id: ReplicaId) {
        if let Some(r) = self.replicas.get_mut(id) {
            r.consecutive_failures = 0;
            r.ejections = 0;
        }
    }

    /// A request to the replica, or a health check of it, failed: after
    /// `ejection.after_failures` in a row it is ejected, for a back-off that doubles with each
    /// ejection until a request succeeds.
    pub fn failed(&mut self, id: ReplicaId, now_ms: u64, ejection: Ejection) -> FailureOutcome {
        let Some(r) = self.replicas.get_mut(id) else {
            return FailureOutcome::Counted;
        };
        r.consecutive_failures += 1;
        if r.consecutive_failures < ejection.after_failures || r.is_ejected(now_ms) {
            return FailureOutcome::Counted;
        }
        r.consecutive_failures = 0;
        let backoff = ejection
            .base_ms
            .saturating_mul(1 << r.ejections.min(16))
            .min(ejection.max_ms);
        r.ejections += 1;
        r.healthy = false;
        r.ejected_until_ms = now_ms + backoff;
        FailureOutcome::Ejected(backoff)
    }

    /// An active health check's result. A pass makes the replica eligible again once its
    /// ejection is over, and leaves the failure count and the back-off as they are.
    pub fn checked(
        &mut self,
        id: ReplicaId,
        passed: bool,
        now_ms: u64,
        ejection: Ejection,
    ) -> FailureOutcome {
        if passed {
            if let Some(r) = self.replicas.get_mut(id) {
                r.healthy = true;
            }
            return FailureOutcome::Counted;
        }
        let outcome = self.failed(id, now_ms, ejection);
        if let Some(r) = self.replicas.get_mut(id) {
            r.healthy = false;
        }
        outcome
    }

    /// The models a replica listed at `/v1/models` (or its agent reported).
    pub fn set_discovered_models(&mut self, id: ReplicaId, models: Vec<String>) {
        if let Some(r) = self.replicas.get_mut(id) {
            r.discovered_models = Some(models);
        }
    }

    /// Takes a report from a replica's agent (its KV events go to [`FleetState::kv_events`]).
    /// A report from a new worker process voids what was learnt about the replica's cache.
    pub fn report(
        &mut self,
        id: ReplicaId,
        report: &TelemetryReport,
        now_ms: u64,
    ) -> Option<ReportOutcome> {
        let r = self.replicas.get_mut(id)?;
        if r.spec.models.is_empty() && !report.load.models.is_empty() {
            r.discovered_models = Some(report.load.models.clone());
        }
        let (restarted, gap) = match &r.agent {
            None => (false, 0),
            Some(prev) => (
                prev.instance != report.instance,
                report.seq.saturating_sub(prev.seq + 1),
            ),
        };
        let missed = r.agent.as_ref().map_or(0, |a| a.missed) + gap;
        r.agent = Some(AgentState {
            instance: report.instance,
            seq: report.seq,
            healthy: report.healthy,
            load: report.load.clone(),
            gpus: report.gpus.clone(),
            received_ms: now_ms,
            missed,
        });
        if restarted {
            self.policy.forget(id);
        }
        Some(ReportOutcome {
            restarted,
            missed: gap,
        })
    }

    /// Applies the KV events a replica's agent relayed to the precise prefix index.
    pub fn kv_events(&mut self, id: ReplicaId, update: &KvUpdate) -> Applied {
        self.policy.apply_kv(id, update)
    }

    /// The replicas that may serve `ask`, each with its adapter fit (0 unless the model names
    /// an adapter). A model may name a LoRA adapter: replicas where it is resident serve it,
    /// and so may any replica with adapter slots (it loads the adapter, evicting another if
    /// full), which also covers an adapter resident nowhere yet. Otherwise the replicas that
    /// list the model serve it, else those whose models are not known yet. Two passes over
    /// the fleet, nothing gathered in between: this runs on every decision.
    fn candidates<'s>(
        &'s self,
        ask: &'s Ask<'_>,
    ) -> Result<impl Iterator<Item = (ReplicaId, &'s ReplicaState, f64)> + 's, NoRoute> {
        let in_pool = |r: &ReplicaState| {
            ask.pool
                .iter()
                .all(|(k, v)| r.spec.labels.get(k) == Some(v))
        };
        let pool = move || self.replicas.iter().filter(move |(_, r)| in_pool(r));
        let (mut listed, mut resident, mut capable) = (false, false, false);
        for (_, r) in pool() {
            listed |= r.model_match(ask.model) == ModelMatch::Yes;
            let a = r.adapter(ask.model);
            resident |= a.is_some_and(|a| a.resident);
            capable |= AdapterStatus::capable(a);
        }
        let names_adapter = resident || (!listed && capable);
        let serves = move |r: &ReplicaState| -> Option<f64> {
            let m = r.model_match(ask.model);
            let a = r.adapter(ask.model);
            let keep = if names_adapter {
                m == ModelMatch::Yes || AdapterStatus::capable(a)
            } else if listed {
                m == ModelMatch::Yes
            } else {
                m == ModelMatch::Unknown
            };
            keep.then(|| a.filter(|_| names_adapter).map_or(0.0, AdapterStatus::fit))
        };
        if !pool().any(|(_, r)| serves(r).is_some()) {
            let model = ask.model.to_string();
            return Err(if ask.pool.is_empty() {
                NoRoute::UnknownModel { model }
            } else {
                NoRoute::NotInPool {
                    model,
                    pool: ask.pool.clone(),
                }
            });
        }
        Ok(pool().filter_map(move |(id, r)| serves(r).map(|fit| (id, r, fit))))
    }

    /// Whether some replica that may serve `ask` has room: routable, below its in-flight cap,
    /// and below the KV and queue saturation its agent reports. A request no replica serves
    /// "has room", so that routing reports why.
    pub fn has_room(&self, ask: &Ask<'_>, now_ms: u64) -> bool {
        let Ok(serving) = self.candidates(ask) else {
            return true;
        };
        let c = self.policy.config();
        let mut serving = serving;
        serving.any(|(_, r, _)| {
            r.is_routable(self.ages, now_ms)
                && r.spec.max_in_flight.is_none_or(|cap| r.in_flight < cap)
                && r.reported_kv_usage().is_none_or(|u| u < c.kv_saturation)
                && r.reported_waiting() < c.queue_saturation
        })
    }

    /// The best `top` replicas for `ask`, best first, with each one's breakdown. Changes
    /// nothing: [`FleetState::send`] records where a request went.
    pub fn rank(&self, ask: &Ask<'_>, now_ms: u64, top: usize) -> Result<Decision, NoRoute> {
        let serving = self.candidates(ask)?;
        let views: Vec<ReplicaView> = serving
            .map(|(id, r, adapter_fit)| ReplicaView {
                id,
                healthy: r.is_routable(self.ages, now_ms),
                in_flight: r.in_flight,
                max_in_flight: r.spec.max_in_flight,
                waiting: r.reported_waiting(),
                prefill_backlog: r.prefill_backlog,
                stale: r.freshness(self.ages, now_ms) == Freshness::Stale,
                kv_usage: r.reported_kv_usage(),
                adapter_fit,
            })
            .collect();
        let decision = self
            .policy
            .select_top(ask.features, FleetView { replicas: &views }, top);
        if decision.ranked.is_empty() {
            return Err(NoRoute::NoneHealthy {
                model: ask.model.to_string(),
            });
        }
        Ok(decision)
    }

    /// Ranks `ask` and sends it to the best replica at once, so that the next decision sees
    /// it there.
    pub fn route(
        &mut self,
        request: RequestId,
        ask: &Ask<'_>,
        now_ms: u64,
        top: usize,
    ) -> Result<Decision, NoRoute> {
        let decision = self.rank(ask, now_ms, top)?;
        self.send(request, &decision.ranked[0], ask.features);
        Ok(decision)
    }

    /// The request went to `choice`'s replica (first, or on a retry after its previous replica
    /// failed it): counted in flight there, its prompt in the prefill backlog until its first
    /// token, its prefix and session learnt.
    pub fn send(&mut self, request: RequestId, choice: &Candidate, features: &RequestFeatures) {
        self.finished(request);
        let Some(r) = self.replicas.get_mut(choice.replica) else {
            return;
        };
        r.in_flight += 1;
        r.prefill_backlog += choice.prefill_tokens;
        r.last_decision = Some(*choice);
        self.requests.insert(
            request,
            Sent {
                replica: choice.replica,
                prefill_tokens: choice.prefill_tokens,
            },
        );
        self.policy.record_choice(choice, features);
    }

    /// The request's first token arrived: its prompt is no longer queued prefill.
    pub fn first_token(&mut self, request: RequestId) {
        let Some(sent) = self.requests.get_mut(&request) else {
            return;
        };
        let tokens = std::mem::take(&mut sent.prefill_tokens);
        if let Some(r) = self.replicas.get_mut(sent.replica) {
            r.prefill_backlog = r.prefill_backlog.saturating_sub(tokens);
        }
    }

    /// The request ended, whole or not.
    pub fn finished(&mut self, request: RequestId) {
        let Some(sent) = self.requests.remove(&request) else {
            return;
        };
        if let Some(r) = self.replicas.get_mut(sent.replica) {
            r.prefill_backlog = r.prefill_backlog.saturating_sub(sent.prefill_tokens);
            r.in_flight = r.in_flight.saturating_sub(1);
        }
    }

    /// Requests in flight, fleet-wide.
    pub fn requests_in_flight(&self) -> usize {
        self.requests.len()
    }
}

#[cfg(test)]
mod tests;
