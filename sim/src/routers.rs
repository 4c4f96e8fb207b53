//! What decides where a request goes: kvgate's policy (a gateway's `FleetState`), a peer's
//! algorithm, or the oracle.

use kvgate_policies::PolicyConfig;

/// Every router's name (kvgate's presets and policy files are named by the CLI).
pub const NAMES: [&str; 8] = [
    "kvgate",
    "round-robin",
    "least-load",
    "sglang-cache-aware",
    "vllm-consistent-hash",
    "llm-d",
    "dynamo",
    "oracle",
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
    /// llm-d's default scorers ([`crate::peers::Llmd`]).
    Llmd,
    /// NVIDIA Dynamo's KV router ([`crate::peers::Dynamo`]).
    Dynamo,
    /// Perfect, instant knowledge of every engine ([`crate::oracle`]).
    Oracle,
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
            "llm-d" => Ok(Router::Llmd),
            "dynamo" => Ok(Router::Dynamo),
            "oracle" => Ok(Router::Oracle),
            _ => Err(format!(
                "unknown policy `{name}` (known: {})",
                NAMES.join(", ")
            )),
        }
    }
}
