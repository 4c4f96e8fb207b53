//! What decides where a request goes: kvgate's policy (a gateway's `FleetState`), or a peer's
//! algorithm.

use kvgate_policies::PolicyConfig;

/// Every router's name.
pub const NAMES: [&str; 5] = [
    "kvgate",
    "round-robin",
    "least-load",
    "sglang-cache-aware",
    "vllm-consistent-hash",
];

#[derive(Debug, Clone, PartialEq)]
pub enum Router {
    /// kvgate's policy, with these settings.
    Kvgate(PolicyConfig),
    /// Each gateway sends to the replicas in turn.
    RoundRobin,
    /// Each gateway sends to the replica with the fewest of its requests in flight (ties in
    /// turn).
    LeastLoad,
    /// SGLang router's `cache_aware` ([`crate::peers::CacheAware`]), one tree per gateway.
    SglangCacheAware,
    /// vLLM router's `consistent_hash` ([`crate::peers::ConsistentHash`]).
    VllmConsistentHash,
}

impl Router {
    /// A router by name (see [`NAMES`]; `kvgate` is the default policy).
    pub fn named(name: &str) -> Result<Router, String> {
        match name {
            "kvgate" => Ok(Router::Kvgate(PolicyConfig::default())),
            "round-robin" => Ok(Router::RoundRobin),
            "least-load" => Ok(Router::LeastLoad),
            "sglang-cache-aware" => Ok(Router::SglangCacheAware),
            "vllm-consistent-hash" => Ok(Router::VllmConsistentHash),
            _ => Err(format!(
                "unknown policy `{name}` (known: {})",
                NAMES.join(", ")
            )),
        }
    }
}
