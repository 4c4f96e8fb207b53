//! What decides where a request goes: kvgate's policy (a gateway's `FleetState`), a peer's
//! algorithm, a look-ahead, or a replay of routes found before; and the policies a run names,
//! the oracle among them.

use kvgate_policies::PolicyConfig;
use std::collections::BTreeMap;
use std::sync::Arc;

/// Every policy's name (kvgate's presets and policy files are named by the CLI).
pub const NAMES: [&str; 9] = [
    "kvgate",
    "round-robin",
    "least-load",
    "sglang-cache-aware",
    "vllm-consistent-hash",
    "llm-d",
    "dynamo",
    "soonest-first-token",
    "oracle",
];

/// What a run routes by: one router, or the oracle's search over runs ([`crate::oracle`]).
// A run holds a handful of these: their size does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum Policy {
    Route(Router),
    Oracle,
}

impl Policy {
    /// A policy by name (see [`NAMES`]; `kvgate` is the default policy).
    pub fn named(name: &str) -> Result<Policy, String> {
        let router = match name {
            "kvgate" => Router::Kvgate(Box::default()),
            "round-robin" => Router::RoundRobin,
            "least-load" => Router::LeastLoad,
            "sglang-cache-aware" => Router::SglangCacheAware,
            "vllm-consistent-hash" => Router::VllmConsistentHash,
            "llm-d" => Router::Llmd,
            "dynamo" => Router::Dynamo,
            "soonest-first-token" => Router::SoonestFirstToken,
            "oracle" => return Ok(Policy::Oracle),
            _ => {
                return Err(format!(
                    "unknown policy `{name}` (known: {})",
                    NAMES.join(", ")
                ))
            }
        };
        Ok(Policy::Route(router))
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum Router {
    /// kvgate's policy, with these settings.
    Kvgate(Box<PolicyConfig>),
    /// Each gateway sends to the replicas in turn.
    RoundRobin,
    /// Each gateway sends to the replica with the fewest of its requests in flight (ties in
    /// its own turn).
    LeastLoad,
    /// SGLang router's `cache_aware` ([`crate::peers::CacheAware`]), one tree per gateway.
    SglangCacheAware,
    /// vLLM router's `consistent_hash` ([`crate::peers::ConsistentHash`]).
    VllmConsistentHash,
    /// llm-d's default scorers ([`crate::peers::Llmd`]).
    Llmd,
    /// NVIDIA Dynamo's KV router ([`crate::peers::Dynamo`]).
    Dynamo,
    /// Perfect, instant knowledge of every engine, one request at a time: where its first
    /// token comes soonest ([`crate::lookahead`]).
    SoonestFirstToken,
    /// Each turn where these routes sent it (a turn they lack: by its job, in turn).
    Replay(Arc<Routes>),
}

/// A job's turn: what stays the same about a request from one run of a workload to the next
/// (request ids follow the order of sending, which a closed loop's routing changes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Turn {
    pub job: usize,
    pub turn: usize,
}

/// Where a run sent each turn: its request id there, and the replica.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Routes(BTreeMap<Turn, (u64, usize)>);

impl Routes {
    pub fn insert(&mut self, turn: Turn, id: u64, replica: usize) {
        self.0.insert(turn, (id, replica));
    }

    pub fn replica(&self, turn: Turn) -> Option<usize> {
        self.0.get(&turn).map(|&(_, r)| r)
    }

    /// Every turn with its request id and replica.
    pub fn iter(&self) -> impl Iterator<Item = (Turn, u64, usize)> + '_ {
        self.0.iter().map(|(&t, &(id, r))| (t, id, r))
    }

    /// Sends `turn` (if these routes have it) to `replica`.
    pub fn set(&mut self, turn: Turn, replica: usize) {
        if let Some(entry) = self.0.get_mut(&turn) {
            entry.1 = replica;
        }
    }
}
