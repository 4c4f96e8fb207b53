//! The fleet as one gateway sees it, with no clock of its own: the replicas and what they serve,
//! the requests in flight on each, their agents' reports, their health, and the routing policy's
//! learnt state (prefix indexes, ring, sessions). It takes timestamped events and answers ranked
//! decisions with their breakdown; the gateway is the I/O shell around it, and the simulator
//! drives the same type in virtual time.

use crate::peer_backlog::PeerBacklogs;
use crate::replica_state::{AdapterStatus, ModelMatch, Slots};
use crate::{
    AgentState, Applied, Candidate, Decision, FleetView, Freshness, Policy, PolicyConfig,
    ReplicaId, ReplicaSpec, ReplicaState, ReplicaView, ReportAges, RequestFeatures, StepClock,
    TierValues,
};
use kvgate_protocol::telemetry::{KvUpdate, TelemetryReport, MAX_GATEWAYS};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

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

/// What a report changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReportOutcome {
    /// The worker process is a new one: what was learnt about its cache is void.
    pub restarted: bool,
    /// Reports missed since the previous one.
    pub missed: u64,
}

/// The fleet and the policy's learnt state; see the module documentation.
#[derive(Debug, Clone)]
pub struct FleetState {
    policy: Policy,
    ages: Option<ReportAges>,
    replicas: Slots,
    /// The replica of each request sent and not yet seen to end.
    requests: HashMap<RequestId, ReplicaId>,
    peer_backlogs: PeerBacklogs,
    /// This gateway and its peers (`peers:`), which tell one another their decisions.
    peer_group: u32,
    /// The most gateways any agent says it reports to.
    reported_gateways: u32,
}

impl FleetState {
    pub fn new(config: PolicyConfig, ages: Option<ReportAges>) -> Self {
        FleetState {
            policy: Policy::new(config),
            ages,
            replicas: Slots::default(),
            requests: HashMap::new(),
            peer_backlogs: PeerBacklogs::default(),
            peer_group: 1,
            reported_gateways: 1,
        }
    }

    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    pub fn report_ages(&self) -> Option<ReportAges> {
        self.ages
    }

    /// This gateway and its peers, which tell one another their decisions (1 without
    /// `peers:`). The gateways routing to the fleet are at least these, and as many as any
    /// agent says it reports to: see [`Policy::set_gateways`].
    pub fn set_peer_group(&mut self, gateways: u32) {
        self.peer_group = gateways.max(1);
        self.update_gateways();
    }

    /// The gateways routing to this fleet as far as this one knows, itself included.
    pub fn gateways(&self) -> u32 {
        self.peer_group.max(self.reported_gateways)
    }

    /// Of [`FleetState::gateways`], those whose decisions this one sees: itself and its peers.
    pub fn gateways_seen(&self) -> u32 {
        self.peer_group
    }

    fn update_gateways(&mut self) {
        self.policy.set_gateways(self.gateways(), self.peer_group);
    }

    /// An agent that said `before` gateways now says `now`: the most any says, found again
    /// over every agent only where the one that said the most says fewer.
    fn agent_gateways_changed(&mut self, before: u32, now: u32) {
        if now >= self.reported_gateways {
            self.reported_gateways = now;
        } else if before == self.reported_gateways {
            self.reported_gateways = self.most_gateways_reported();
        } else {
            return;
        }
        self.update_gateways();
    }

    fn most_gateways_reported(&self) -> u32 {
        self.replicas
            .iter()
            .filter_map(|(_, r)| r.agent.as_ref().map(|a| a.gateways))
            .fold(1, u32::max)
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
                    prefill: old.prefill,
                    ..ReplicaState::new(spec)
                },
                _ => ReplicaState::new(spec),
            };
            next.put(id, state);
        }
        self.replicas = next;
        self.peer_backlogs.clear();
        self.reported_gateways = self.most_gateways_reported();
        self.update_gateways();
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
        let gateways_before = r.agent.as_ref().map_or(1, |a| a.gateways);
        let gateways = report.gateways.unwrap_or(1).clamp(1, MAX_GATEWAYS);
        r.agent = Some(AgentState {
            instance: report.instance,
            seq: report.seq,
            healthy: report.healthy,
            load: report.load.clone(),
            gpus: report.gpus.clone(),
            received_ms: now_ms,
            missed,
            gateways,
        });
        self.agent_gateways_changed(gateways_before, gateways);
        if restarted {
            self.policy.forget(id);
        }
        let values = TierValues {
            host: report.load.host_block_value,
            disk: report.load.disk_block_value,
        };
        self.policy.set_tier_values(id, values);
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
        let peers = self.peer_backlogs.totals(now_ms, self.replicas.len());
        let views: Vec<ReplicaView> = serving
            .map(|(id, r, adapter_fit)| ReplicaView {
                id,
                healthy: r.is_routable(self.ages, now_ms),
                in_flight: r.in_flight,
                max_in_flight: r.spec.max_in_flight,
                waiting: r.reported_waiting(),
                prefill_backlog: r
                    .prefill_backlog()
                    .saturating_add(peers.get(id.0 as usize).copied().unwrap_or(0)),
                // At the request's own time, so that the ranking follows from the events.
                prefill_progress: r.prefill.progress(ask.features.now_ms),
                step_wait: r.step_wait(ask.features.now_us),
                admit_interval: r.admit_interval(),
                kv_queue: r.queued_now(now_ms),
                stale: r.freshness(self.ages, now_ms) == Freshness::Stale,
                kv_usage: r.reported_kv_usage(),
                kv_empty_tokens: self
                    .policy
                    .precise_index()
                    .device_blocks(id)
                    .and_then(|cached| r.reported_kv_room(cached)),
                kv_capacity_tokens: r.reported_kv_capacity(),
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
        // Sent at the request's own time, as it was ranked.
        self.send(
            request,
            &decision.ranked[0],
            ask.features,
            ask.features.now_ms,
        );
        Ok(decision)
    }

    /// The request went to `choice`'s replica (first, or on a retry after its previous replica
    /// failed it): counted in flight there, its prompt in the prefill backlog until its first
    /// token, its prefix and session learnt. `sent_ms`: when, which for a retry is later than
    /// the request's arrival.
    pub fn send(
        &mut self,
        request: RequestId,
        choice: &Candidate,
        features: &RequestFeatures,
        sent_ms: u64,
    ) {
        self.finished(request);
        let Some(r) = self.replicas.get_mut(choice.replica) else {
            return;
        };
        r.in_flight += 1;
        r.prefill.sent(request, choice.prefill_tokens, sent_ms);
        r.last_decision = Some(*choice);
        self.requests.insert(request, choice.replica);
        self.policy.record_choice(choice, features);
    }

    /// Another gateway sent a request with these features to `replica`: its prefix (and
    /// session) are assumed there as if this gateway had sent it, though it is not in flight
    /// here.
    pub fn peer_sent(&mut self, replica: ReplicaId, features: &RequestFeatures) {
        if self.replicas.get(replica).is_some() {
            self.policy.record(replica, features);
        }
    }

    /// The prefill this gateway has queued on each replica (those with none left out), for
    /// its peers: see [`FleetState::peer_backlog`].
    pub fn backlogs(&self) -> Vec<(ReplicaId, u64)> {
        self.replicas
            .iter()
            .filter(|(_, r)| r.prefill_backlog() > 0)
            .map(|(id, r)| (id, r.prefill_backlog()))
            .collect()
    }

    /// Peer gateway `peer` (any stable id) has `backlog` queued per replica, as its
    /// [`FleetState::backlogs`] said, until `expires_ms` unless it says otherwise before:
    /// counted in the prefill ahead on each replica beside this gateway's own.
    pub fn peer_backlog(&mut self, peer: u64, backlog: Vec<(ReplicaId, u64)>, expires_ms: u64) {
        self.peer_backlogs.set(peer, backlog, expires_ms);
    }

    /// The request's first token arrived at `now_ms`: its prompt is no longer queued prefill.
    pub fn first_token(&mut self, request: RequestId, now_ms: u64) {
        let Some(&replica) = self.requests.get(&request) else {
            return;
        };
        if let Some(r) = self.replicas.get_mut(replica) {
            r.prefill.first_token(request, now_ms);
        }
    }

    /// A token of the request's stream arrived at `now_us`, its previous one at `previous_us`:
    /// its replica ended a step ([`StepClock::token`]).
    pub fn token(&self, request: RequestId, now_us: u64, previous_us: Option<u64>) {
        if let Some(clock) = self
            .requests
            .get(&request)
            .and_then(|&r| self.step_clock(r))
        {
            clock.token(now_us, previous_us);
        }
    }

    /// The clock of `replica`'s engine steps, for a proxy thread to tell of the tokens it
    /// passes on without this state's lock ([`StepClock::token`]).
    pub fn step_clock(&self, replica: ReplicaId) -> Option<Arc<StepClock>> {
        self.replicas.get(replica).map(|r| Arc::clone(&r.steps))
    }

    /// The request's stream ran from its first token at `first_us` to its last at `last_us`
    /// (µs on the gateway's clock): how long its replica's requests hold their KV blocks,
    /// learnt. Before [`FleetState::finished`].
    pub fn streamed(&mut self, request: RequestId, first_us: u64, last_us: u64) {
        let Some(&replica) = self.requests.get(&request) else {
            return;
        };
        if let Some(r) = self.replicas.get_mut(replica) {
            r.streams.ended(first_us, last_us);
        }
    }

    /// The request ended, whole or not.
    pub fn finished(&mut self, request: RequestId) {
        let Some(replica) = self.requests.remove(&request) else {
            return;
        };
        if let Some(r) = self.replicas.get_mut(replica) {
            r.prefill.finished(request);
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
