//! One replica as a gateway's fleet state keeps it: its spec, health, ejection back-off,
//! requests in flight, its agent's last report, and what it may serve.

use crate::prefill_queue::PrefillQueue;
use crate::step_clock::StepClock;
use crate::stream_time::StreamTime;
use crate::{Candidate, ReplicaId};
use kvgate_protocol::telemetry::{EngineLoad, GpuStats};
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::Arc;

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
    /// The gateways it reports to (1 when it does not say).
    pub gateways: u32,
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
    /// Its in-flight requests still awaiting their first token, and how far it has got
    /// through them.
    pub(crate) prefill: PrefillQueue,
    /// When its engine's step under way likely ends (shared with the proxy threads that see
    /// its tokens: [`crate::FleetState::step_clock`]).
    pub(crate) steps: Arc<StepClock>,
    /// How long its streams have lately run, first token to last.
    pub(crate) streams: StreamTime,
    /// The scores of the last request sent to it.
    pub last_decision: Option<Candidate>,
}

impl ReplicaState {
    pub(crate) fn new(spec: ReplicaSpec) -> Self {
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
            prefill: PrefillQueue::default(),
            steps: Arc::default(),
            streams: StreamTime::default(),
            last_decision: None,
        }
    }

    /// Prompt tokens of its in-flight requests still awaiting their first token, less what
    /// each decision found it holding.
    pub fn prefill_backlog(&self) -> u64 {
        self.prefill.backlog()
    }

    /// The rest of its engine's step under way at `now_us`, in prompt tokens at the pace its
    /// first tokens have come (0 while either is unknown).
    pub fn step_wait(&self, now_us: u64) -> u64 {
        // Nothing in flight from here: likely idle, a request starts a step at once.
        if now_us == 0 || self.in_flight == 0 {
            return 0;
        }
        let pace = self.prefill.pace().unwrap_or(0.0);
        (self.steps.wait_us(now_us) as f64 / 1_000.0 * pace) as u64
    }

    /// How often its engine likely ends a running request and frees its KV blocks (ms): its
    /// streams' recent mean length over the requests its agent last reported running (`None`
    /// while either is unknown or none run).
    fn admit_interval_ms(&self) -> Option<f64> {
        let running = self.agent.as_ref().map_or(0, |a| a.load.running);
        let stream_us = self.streams.mean_us()?;
        (running > 0).then(|| stream_us / 1_000.0 / f64::from(running))
    }

    /// [`ReplicaState::admit_interval_ms`] in prompt tokens at the pace its first tokens have
    /// come (0 while unknown).
    pub fn admit_interval(&self) -> u64 {
        match (self.admit_interval_ms(), self.prefill.pace()) {
            (Some(ms), Some(pace)) => (ms * pace) as u64,
            _ => 0,
        }
    }

    /// Requests its engine likely queues at `now_ms`: those its agent last reported, less one
    /// started every admit interval since the report (all of them while that is unknown).
    pub fn queued_now(&self, now_ms: u64) -> u32 {
        let Some(agent) = &self.agent else {
            return 0;
        };
        let age_ms = now_ms.saturating_sub(agent.received_ms) as f64;
        let started = self
            .admit_interval_ms()
            .map_or(0.0, |ms| (age_ms / ms.max(0.001)).floor());
        (f64::from(agent.load.waiting) - started).max(0.0) as u32
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

    /// Tokens the KV blocks its agent last reported can take beside its running requests'
    /// and `cached` more blocks (`None` without reports, or when the engine reports no KV
    /// blocks or block size).
    pub fn reported_kv_room(&self, cached: u64) -> Option<u64> {
        self.reported_kv_tokens(|l| {
            l.kv_blocks_total
                .saturating_sub(l.kv_blocks_used.saturating_add(cached))
        })
    }

    /// Tokens all the KV blocks its agent last reported take (`None` as for
    /// [`ReplicaState::reported_kv_room`]).
    pub fn reported_kv_capacity(&self) -> Option<u64> {
        self.reported_kv_tokens(|l| l.kv_blocks_total)
    }

    /// The tokens of `blocks` of its last report's KV blocks, where it reports blocks and
    /// their size.
    fn reported_kv_tokens(&self, blocks: impl Fn(&EngineLoad) -> u64) -> Option<u64> {
        self.agent
            .as_ref()
            .map(|a| &a.load)
            .filter(|l| l.kv_blocks_total > 0 && l.block_size > 0)
            .map(|l| blocks(l).saturating_mul(u64::from(l.block_size)))
    }

    /// How well it suits a request naming adapter `model`, from its agent's report: `None`
    /// without reports; else whether it is resident and whether a slot is free to load it.
    pub(crate) fn adapter(&self, model: &str) -> Option<AdapterStatus> {
        self.agent.as_ref().map(|a| AdapterStatus {
            resident: a.load.adapters.iter().any(|m| m == model),
            slots_free: a.load.adapter_slots_free,
        })
    }

    pub(crate) fn model_match(&self, model: &str) -> ModelMatch {
        match self.models() {
            None => ModelMatch::Unknown,
            Some(models) if models.iter().any(|m| m == model) => ModelMatch::Yes,
            Some(_) => ModelMatch::No,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ModelMatch {
    Yes,
    No,
    Unknown,
}

/// An adapter as a replica's agent reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AdapterStatus {
    pub(crate) resident: bool,
    /// Free adapter slots (`None`: the engine does not say, or serves no adapters).
    pub(crate) slots_free: Option<u32>,
}

impl AdapterStatus {
    /// 1 resident, 0.5 a free slot to load it into, 0 neither (it would evict another).
    pub(crate) fn fit(self) -> f64 {
        match (self.resident, self.slots_free) {
            (true, _) => 1.0,
            (false, Some(free)) if free > 0 => 0.5,
            _ => 0.0,
        }
    }

    pub(crate) fn capable(status: Option<Self>) -> bool {
        status.is_some_and(|a| a.slots_free.is_some())
    }
}

/// Replicas by slot: slots are small and dense (the gateway hands them out from 0).
#[derive(Debug, Clone, Default)]
pub(crate) struct Slots(Vec<Option<ReplicaState>>);

impl Slots {
    pub(crate) fn get(&self, id: ReplicaId) -> Option<&ReplicaState> {
        self.0.get(id.0 as usize)?.as_ref()
    }

    pub(crate) fn get_mut(&mut self, id: ReplicaId) -> Option<&mut ReplicaState> {
        self.0.get_mut(id.0 as usize)?.as_mut()
    }

    pub(crate) fn take(&mut self, id: ReplicaId) -> Option<ReplicaState> {
        self.0.get_mut(id.0 as usize)?.take()
    }

    pub(crate) fn put(&mut self, id: ReplicaId, state: ReplicaState) {
        let i = id.0 as usize;
        if self.0.len() <= i {
            self.0.resize_with(i + 1, || None);
        }
        self.0[i] = Some(state);
    }

    /// Slots, the empty ones included.
    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (ReplicaId, &ReplicaState)> {
        self.0
            .iter()
            .enumerate()
            .filter_map(|(i, r)| Some((ReplicaId(i as u32), r.as_ref()?)))
    }
}
