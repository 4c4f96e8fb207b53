//! The `policy:` section of the gateway config.

use crate::signal::{BySignal, Signal};
use serde::{Deserialize, Serialize};
use std::ops::Index;

/// Routing policy settings. Every field has a default, so `policy:` may be omitted.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PolicyConfig {
    /// Weights of the signals in the total score.
    pub weights: Weights,
    /// Bounded-load factor `c` (Mirrokni et al.): prefix and session stickiness and the ring
    /// yield once a replica has `ceil(c * (in_flight + 1) / healthy)` requests (the prefill
    /// signal, which weighs load in tokens, yields only at `imbalance_factor`). 0 turns the
    /// caps off (the default: the prefill signal weighs a holder's backlog against the tokens
    /// a spill recomputes); else at least 1.0.
    pub load_factor: f64,
    /// Loosens the bound where staying saves prefill: a replica holding a fraction `f` more of
    /// the prompt than the fleet's least-holding replica may carry
    /// `ceil((load_factor + cached_load_bonus * f) * (in_flight + 1) / healthy)`. Cold
    /// placement keeps the tight bound. 0 turns it off.
    pub cached_load_bonus: f64,
    /// The hard bound every signal yields to: `imbalance_factor * (in_flight + 1)` of the
    /// least-loaded healthy replica, or a whole-prompt holder's cap if that is more. Without
    /// it, replicas holding a prefix every prompt shares could take all the traffic while one
    /// that does not hold it idles. 0 turns it off; else at least 1.
    pub imbalance_factor: f64,
    /// No bounded-load cap is below this many requests in flight (nor the imbalance guard,
    /// which is never below a holder's cap): an engine batches, so a replica with a few
    /// requests is not loaded, and spilling a prefix from it only costs a prefill. It counts
    /// requests from every gateway: a gateway that knows it has peers (`peers:`) floors its
    /// caps at its share, `min_load_cap / gateways` rounded up. At least 1.
    pub min_load_cap: u32,
    /// Virtual nodes per replica on the consistent-hash ring.
    pub ring_vnodes: u32,
    /// The cold-prefix key hashes this many leading text chunks, or token blocks in token mode
    /// (or the whole prompt if shorter).
    pub ring_key_chunks: usize,
    /// Text mode: bytes per prefix chunk.
    pub chunk_bytes: usize,
    /// Text mode: chunk hashes remembered per replica (least recently used dropped first).
    pub prefix_capacity: usize,
    /// Token mode: a routing decision assumes the chosen replica holds the prompt's blocks for
    /// this long, whatever its KV events show meanwhile: they cover the time until its events
    /// arrive and, through an eviction, keep a recurring group on the replica that computes it
    /// again (`select/kv_room.rs`).
    /// `speculative_ttl_ms`, its old name, is still read.
    #[serde(alias = "speculative_ttl_ms")]
    pub assumed_ttl_ms: u64,
    /// A session keeps its replica while it sends a request at least this often.
    pub session_ttl_ms: u64,
    /// Sessions remembered at most (idle ones are forgotten first).
    pub session_capacity: usize,
    /// A replica whose agent reports this fraction of its KV blocks in use is saturated: prefix
    /// and session stickiness yield, as they do to the load bound (the prefill signal still
    /// counts what it holds).
    pub kv_saturation: f64,
    /// A replica whose agent reports this many requests queued is at a hard limit: the prefill
    /// signal yields too.
    pub queue_saturation: u32,
    /// The prefill signal counts each prompt token a replica would compute although another
    /// candidate holds it this many times more: recomputing a held prefix delays everything
    /// queued behind it there, and spreads copies that evict other prefixes; where the
    /// healthy replicas have more than a prompt's work ahead on average, that many times more
    /// (the fleet is short of capacity, and a copy adds to its work). 0: every token counts
    /// once. Lifted for a hot group (`hot_group_factor`) and for a session's request (its own
    /// history serves only its next turn).
    pub recompute_penalty: f64,
    /// The recompute, in tokens, at which `recompute_penalty` reaches its full weight; a
    /// shorter one is penalised in proportion to its length, or to the share of the replica's
    /// KV blocks its running requests use where that is more (all of it when it reports no KV
    /// use). A copy delays the requests that arrive while it is computed, so its cost grows
    /// with its length twice over: a short one delays few requests, and those briefly. Only
    /// for a group with at least as many recent requests as healthy replicas (one seen once or
    /// twice would not use a copy again), and none for its copy to a replica where it costs
    /// others nothing (no prefill queued, empty KV blocks to take it). 0: the full weight at
    /// every length, always.
    pub recompute_penalty_full_at: u64,
    /// Bounded-traffic placement: the ring owner (where a cold prefix goes, and a spilled one)
    /// is the first replica clockwise, below its load cap, whose recent traffic is at most
    /// `traffic_bound * (traffic + 1) / healthy`, so that prefixes spread by the traffic they
    /// bring rather than by where their hashes fall. Traffic is the requests routed to a
    /// replica, halved every `traffic_half_life_ms`. 0 turns it off; else at least 1.
    pub traffic_bound: f64,
    /// How long a request counts fully in a replica's recent traffic (see `traffic_bound`).
    pub traffic_half_life_ms: u64,
    /// A prefix group (the prompts sharing their first `ring_key_chunks` blocks) is hot when
    /// its recent traffic is more than this many times the fair share of the replicas holding
    /// it (by more than a count's noise, unless it is all the traffic yet, as the first
    /// requests of one system prompt are): other replicas then recompute it without
    /// `recompute_penalty`, a one-time cost for a lasting spread.
    pub hot_group_factor: f64,
    /// Replicas whose totals are within this of the best, holding as much of the prompt as
    /// the best and some of it, are a tie, and the request goes to one of them drawn at random
    /// (`RequestFeatures::tie_draw`): differences this small come from reports up to an
    /// interval old (KV use) or from the ring's order, which every gateway sees alike, so
    /// gateways that share no decisions would otherwise all send to the same one. A prompt no
    /// replica holds keeps the ring's order, so that gateways agree where a prefix goes. 0: the
    /// best total always wins.
    pub tie_margin: f64,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig {
            weights: Weights::default(),
            load_factor: 0.0,
            cached_load_bonus: 0.0,
            imbalance_factor: 0.0,
            min_load_cap: 8,
            ring_vnodes: 40,
            ring_key_chunks: 4,
            chunk_bytes: 256,
            prefix_capacity: 100_000,
            assumed_ttl_ms: 3_000,
            session_ttl_ms: 600_000,
            session_capacity: 100_000,
            kv_saturation: 1.0,
            queue_saturation: 256,
            recompute_penalty: 2.0,
            recompute_penalty_full_at: 2_048,
            traffic_bound: 0.0,
            traffic_half_life_ms: 10_000,
            hot_group_factor: 1.0,
            tie_margin: 0.02,
        }
    }
}

/// Weights of the normalised signals (each in [0, 1]; see [`Signal`]), by name in the config;
/// a weight not given keeps its default.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(transparent)]
pub struct Weights(pub BySignal);

impl Default for Weights {
    fn default() -> Self {
        let mut w = BySignal::default();
        for (s, v) in [
            (Signal::Prefix, 1.0),
            (Signal::Ring, 0.0),
            (Signal::Load, 1.0),
            (Signal::Prefill, 6.0),
            (Signal::Fresh, 1.0),
            (Signal::Session, 5.0),
            (Signal::Kv, 1.0),
            (Signal::Adapter, 4.0),
            (Signal::Spread, 4.0),
        ] {
            w[s] = v;
        }
        Weights(w)
    }
}

impl<'de> Deserialize<'de> for Weights {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        crate::signal::read_map(deserializer, Weights::default().0).map(Weights)
    }
}

impl Index<Signal> for Weights {
    type Output = f64;
    fn index(&self, s: Signal) -> &f64 {
        &self.0[s]
    }
}

impl Weights {
    /// Sets the weight named `name` (as in the config) to a finite `value` >= 0.
    pub fn set(&mut self, name: &str, value: f64) -> Result<(), String> {
        if !(value.is_finite() && value >= 0.0) {
            return Err(format!("must be a finite number >= 0, got {value}"));
        }
        let s = Signal::from_name(name)
            .ok_or_else(|| format!("unknown weight `{name}` (known: {})", Signal::names()))?;
        self.0[s] = value;
        Ok(())
    }
}

impl PolicyConfig {
    /// Problems with the values, each as (field path under `policy`, message).
    pub fn validate(&self) -> Vec<(String, String)> {
        let mut errors = Vec::new();
        let mut check = |ok: bool, path: &str, msg: String| {
            if !ok {
                errors.push((path.to_string(), msg));
            }
        };
        check(
            self.load_factor == 0.0 || (self.load_factor.is_finite() && self.load_factor >= 1.0),
            "load_factor",
            format!(
                "must be 0 (off) or a number >= 1.0, got {}",
                self.load_factor
            ),
        );
        check(
            (0.0..=16.0).contains(&self.cached_load_bonus),
            "cached_load_bonus",
            format!(
                "must be a number between 0 and 16, got {}",
                self.cached_load_bonus
            ),
        );
        check(
            self.imbalance_factor == 0.0 || (1.0..=1000.0).contains(&self.imbalance_factor),
            "imbalance_factor",
            format!(
                "must be 0 (off) or between 1 and 1000, got {}",
                self.imbalance_factor
            ),
        );
        check(
            (1..=100_000).contains(&self.min_load_cap),
            "min_load_cap",
            format!("must be between 1 and 100000, got {}", self.min_load_cap),
        );
        check(
            (1..=1024).contains(&self.ring_vnodes),
            "ring_vnodes",
            format!("must be between 1 and 1024, got {}", self.ring_vnodes),
        );
        check(
            self.ring_key_chunks >= 1,
            "ring_key_chunks",
            "must be at least 1, got 0".into(),
        );
        check(
            (16..=65_536).contains(&self.chunk_bytes),
            "chunk_bytes",
            format!("must be between 16 and 65536, got {}", self.chunk_bytes),
        );
        check(
            (1..=100_000_000).contains(&self.prefix_capacity),
            "prefix_capacity",
            format!(
                "must be between 1 and 100000000, got {}",
                self.prefix_capacity
            ),
        );
        check(
            self.kv_saturation > 0.0 && self.kv_saturation <= 1.0,
            "kv_saturation",
            format!("must be in (0, 1], got {}", self.kv_saturation),
        );
        check(
            (0.0..=64.0).contains(&self.recompute_penalty),
            "recompute_penalty",
            format!(
                "must be a number between 0 and 64, got {}",
                self.recompute_penalty
            ),
        );
        check(
            self.recompute_penalty_full_at <= 100_000_000,
            "recompute_penalty_full_at",
            format!(
                "must be a number of tokens up to 100000000, got {}",
                self.recompute_penalty_full_at
            ),
        );
        check(
            self.traffic_bound == 0.0 || (1.0..=1000.0).contains(&self.traffic_bound),
            "traffic_bound",
            format!(
                "must be 0 (off) or between 1 and 1000, got {}",
                self.traffic_bound
            ),
        );
        check(
            (1..=3_600_000).contains(&self.traffic_half_life_ms),
            "traffic_half_life_ms",
            format!(
                "must be between 1 and 3600000, got {}",
                self.traffic_half_life_ms
            ),
        );
        check(
            (0.0..=1000.0).contains(&self.hot_group_factor),
            "hot_group_factor",
            format!(
                "must be a number between 0 and 1000, got {}",
                self.hot_group_factor
            ),
        );
        check(
            (0.0..=100.0).contains(&self.tie_margin),
            "tie_margin",
            format!(
                "must be a number between 0 and 100, got {}",
                self.tie_margin
            ),
        );
        check(
            self.queue_saturation >= 1,
            "queue_saturation",
            "must be at least 1, got 0".into(),
        );
        check(
            self.session_ttl_ms >= 1,
            "session_ttl_ms",
            "must be at least 1, got 0".into(),
        );
        check(
            (1..=100_000_000).contains(&self.session_capacity),
            "session_capacity",
            format!(
                "must be between 1 and 100000000, got {}",
                self.session_capacity
            ),
        );
        for (signal, w) in self.weights.0.iter() {
            check(
                w.is_finite() && w >= 0.0,
                &format!("weights.{}", signal.name()),
                format!("must be a finite number >= 0, got {w}"),
            );
        }
        errors
    }
}
