//! The `policy:` section of the gateway config.

use serde::{Deserialize, Serialize};

/// Routing policy settings. Every field has a default, so `policy:` may be omitted.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PolicyConfig {
    /// Weights of the signals in the total score.
    pub weights: Weights,
    /// Bounded-load factor `c` (Mirrokni et al.): prefix and session stickiness and the ring
    /// yield once a replica has `ceil(c * (in_flight + 1) / healthy)` requests (the prefill
    /// signal, which weighs load in tokens, yields only at `imbalance_factor`). Must be at
    /// least 1.0.
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
    /// Virtual nodes per replica on the consistent-hash ring.
    pub ring_vnodes: u32,
    /// The cold-prefix key hashes this many leading text chunks, or token blocks in token mode
    /// (or the whole prompt if shorter).
    pub ring_key_chunks: usize,
    /// Text mode: bytes per prefix chunk.
    pub chunk_bytes: usize,
    /// Text mode: chunk hashes remembered per replica (least recently used dropped first).
    pub prefix_capacity: usize,
    /// Token mode: a routing decision counts the prompt's blocks as held by the chosen replica
    /// for this long, until the replica's KV events confirm them.
    pub speculative_ttl_ms: u64,
    /// A session keeps its replica while it sends a request at least this often.
    pub session_ttl_ms: u64,
    /// Sessions remembered at most (idle ones are forgotten first).
    pub session_capacity: usize,
    /// A replica whose agent reports this fraction of its KV blocks in use is saturated: prefix
    /// and session stickiness yield, as they do to the load bound.
    pub kv_saturation: f64,
    /// ... and so is one whose agent reports this many requests queued.
    pub queue_saturation: u32,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig {
            weights: Weights::default(),
            load_factor: 1.25,
            cached_load_bonus: 0.5,
            imbalance_factor: 3.0,
            ring_vnodes: 40,
            ring_key_chunks: 4,
            chunk_bytes: 256,
            prefix_capacity: 100_000,
            speculative_ttl_ms: 3_000,
            session_ttl_ms: 600_000,
            session_capacity: 100_000,
            kv_saturation: 0.9,
            queue_saturation: 16,
        }
    }
}

/// Weights of the normalised signals, each in [0, 1].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Weights {
    /// Fraction of the prompt's prefix chunks the replica is believed to hold.
    pub prefix: f64,
    /// 1 for the bounded-load consistent-hash owner of the prompt's first chunks.
    pub ring: f64,
    /// 1 for an idle replica, falling towards 0 as its load (requests in flight from this
    /// gateway plus those its agent reports queued) nears the fleet's busiest.
    pub load: f64,
    /// 1 for the replica with the least prefill ahead of this request's first token (its
    /// prefill backlog plus the share of the prompt it does not hold), falling as that work
    /// grows: a replica with one prompt's length more work than the least scores at most 0.5.
    pub prefill: f64,
    /// 1 unless the replica's agent reports are stale (then 0).
    pub fresh: f64,
    /// 1 for the replica the request's session is bound to, unless it is saturated.
    pub session: f64,
    /// The fraction of its KV cache free, as its agent reports (1 without reports).
    pub kv: f64,
    /// Adapter residency: 1 resident, 0.5 a free slot, 0 neither.
    pub adapter: f64,
}

impl Default for Weights {
    fn default() -> Self {
        Weights {
            prefix: 3.0,
            ring: 1.0,
            load: 1.0,
            prefill: 6.0,
            fresh: 1.0,
            session: 5.0,
            kv: 1.0,
            adapter: 4.0,
        }
    }
}

impl Weights {
    /// Each weight by its name in the config.
    fn named(&mut self) -> [(&'static str, &mut f64); 8] {
        [
            ("prefix", &mut self.prefix),
            ("ring", &mut self.ring),
            ("load", &mut self.load),
            ("prefill", &mut self.prefill),
            ("fresh", &mut self.fresh),
            ("session", &mut self.session),
            ("kv", &mut self.kv),
            ("adapter", &mut self.adapter),
        ]
    }

    /// Sets the weight named `name` (as in the config) to a finite `value` >= 0.
    pub fn set(&mut self, name: &str, value: f64) -> Result<(), String> {
        if !(value.is_finite() && value >= 0.0) {
            return Err(format!("must be a finite number >= 0, got {value}"));
        }
        let mut named = self.named();
        let known: Vec<&str> = named.iter().map(|(n, _)| *n).collect();
        let known = known.join(", ");
        match named.iter_mut().find(|(n, _)| *n == name) {
            Some((_, w)) => {
                **w = value;
                Ok(())
            }
            None => Err(format!("unknown weight `{name}` (known: {known})")),
        }
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
            self.load_factor.is_finite() && self.load_factor >= 1.0,
            "load_factor",
            format!("must be a number >= 1.0, got {}", self.load_factor),
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
        for (name, w) in self.weights.clone().named() {
            check(
                w.is_finite() && *w >= 0.0,
                &format!("weights.{name}"),
                format!("must be a finite number >= 0, got {w}"),
            );
        }
        errors
    }
}
