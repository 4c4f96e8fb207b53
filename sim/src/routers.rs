//! What decides where a request goes: kvgate's policy (a gateway's `FleetState`), or a peer's
//! algorithm.

use kvgate_policies::PolicyConfig;

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
}

impl Router {
    /// A router by name: `kvgate` (the default policy), `round-robin`, `least-load` or
    /// `sglang-cache-aware`.
    pub fn named(name: &str) -> Result<Router, String> {
        match name {
            "kvgate" => Ok(Router::Kvgate(PolicyConfig::default())),
            "round-robin" => Ok(Router::RoundRobin),
            "least-load" => Ok(Router::LeastLoad),
            "sglang-cache-aware" => Ok(Router::SglangCacheAware),
            _ => Err(format!(
                "unknown policy `{name}` (known: kvgate, round-robin, least-load, sglang-cache-aware)"
            )),
        }
    }
}
