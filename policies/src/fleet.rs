//! What a decision looks at: the request's features and a snapshot of the fleet.

/// A replica's stable slot in the policy's state (its index in the membership list given to
/// [`crate::Policy::set_members`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ReplicaId(pub u32);

/// One replica as the gateway sees it at decision time (the default: unhealthy, idle, no
/// reports).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ReplicaView {
    pub id: ReplicaId,
    /// Passed health checks and not ejected.
    pub healthy: bool,
    /// Requests the gateway has in flight on it.
    pub in_flight: u32,
    /// Hard cap on in-flight requests, if configured.
    pub max_in_flight: Option<u32>,
    /// Requests the replica's agent last reported queued (0 without an agent).
    pub waiting: u32,
    /// Prompt tokens the gateway sent it that have not yet produced a first token, less what
    /// each decision found it holding, and what peer gateways said they have queued there:
    /// the prefill ahead of a new request.
    pub prefill_backlog: u64,
    /// Of this gateway's part of that backlog, what the replica has likely computed already:
    /// the request at its front, at the pace its first tokens have come.
    pub prefill_progress: u64,
    /// The rest of the engine step under way there, as the tokens streaming back show, in
    /// prompt tokens at the pace its first tokens have come: a request sent now waits for it
    /// before its prefill starts.
    pub step_wait: u64,
    /// How often its engine likely ends a running request and frees its KV blocks, in the
    /// same tokens: its streams' recent length over the requests it runs (0 while unknown).
    /// Where it has no KV room, each request queued there waits about this long for a start.
    pub admit_interval: u64,
    /// Requests its engine likely queues now: those its agent last reported, less one started
    /// every admit interval since (0 without reports).
    pub kv_queue: u32,
    /// Its agent's last report is older than the stale threshold: scored down.
    pub stale: bool,
    /// Fraction of its KV blocks in use, as its agent last reported (`None` without reports).
    pub kv_usage: Option<f64>,
    /// Tokens its KV blocks holding nothing can take: its agent's last reported blocks, less
    /// those its running requests use and those its KV events show cached on the device
    /// (`None` without both). A copy of a prompt that fits there evicts nothing.
    pub kv_empty_tokens: Option<u64>,
    /// Tokens all its KV blocks take, as its agent last reported (`None` without reports).
    pub kv_capacity_tokens: Option<u64>,
    /// For a request naming a LoRA adapter: 1 if resident here, 0.5 if a slot is free to load
    /// it, else 0 (and 0 for every replica when the request names no adapter).
    pub adapter_fit: f64,
}

impl ReplicaView {
    /// The prefill still ahead of a new request: the backlog less what is likely computed.
    pub fn prefill_ahead(&self) -> u64 {
        self.prefill_backlog.saturating_sub(self.prefill_progress)
    }

    /// Tokens its KV blocks not in use by running requests can take (cached ones give way),
    /// as its agent last reported (`None` without `kv_usage` and `kv_capacity_tokens`).
    pub fn kv_room_tokens(&self) -> Option<u64> {
        let usage = self.kv_usage?.clamp(0.0, 1.0);
        Some(((1.0 - usage) * self.kv_capacity_tokens? as f64) as u64)
    }
}

/// The replicas that may serve this request (those that serve its model), healthy or not.
#[derive(Debug, Clone, Copy)]
pub struct FleetView<'a> {
    pub replicas: &'a [ReplicaView],
}

/// What routing needs to know about a request.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RequestFeatures {
    /// Chained hashes of the prompt's full prefix chunks (text mode).
    pub prefix_chunks: Vec<u64>,
    /// Hashes of the prompt's full token blocks, as the worker computes them (token mode: the
    /// gateway tokenized the prompt). When present, the precise index scores the prefix.
    pub block_hashes: Vec<u64>,
    /// The prompt's length in tokens (text mode: estimated at 4 bytes a token).
    pub prompt_tokens: u64,
    /// Key of the cold-prefix owner on the consistent-hash ring.
    pub ring_key: u64,
    /// Hash of the session the request belongs to (`x-session-id` header, else `user`).
    pub session: Option<u64>,
    /// The gateway's clock (ms since it started): session bindings expire by it.
    pub now_ms: u64,
    /// The same clock in microseconds (0: not known; step phases are then not used).
    pub now_us: u64,
    /// Weights for this request (its SLA class's); the policy's own when `None`.
    pub weights: Option<crate::Weights>,
    /// A number drawn at random for this request: which of the replicas tied within
    /// `tie_margin` it goes to (0 for the first in ring order).
    pub tie_draw: u64,
}

impl RequestFeatures {
    /// Token-mode features of prompt `ids`: its block hashes (as the workers compute them) and
    /// the ring key from its first `ring_key_blocks` blocks (the whole prompt when it is
    /// shorter than one block). The gateway and the simulator both build them here.
    pub fn from_tokens(
        ids: &[u32],
        seed: kvgate_protocol::HashSeed,
        block_size: usize,
        ring_key_blocks: usize,
    ) -> Self {
        let hashes = kvgate_protocol::block_hashes(seed, ids, block_size);
        let ring_key = match hashes.len() {
            0 => {
                let bytes: Vec<u8> = ids.iter().flat_map(|t| t.to_le_bytes()).collect();
                xxhash_rust::xxh3::xxh3_64_with_seed(&bytes, seed.0)
            }
            n => hashes[n.min(ring_key_blocks.max(1)) - 1],
        };
        RequestFeatures {
            prompt_tokens: ids.len() as u64,
            block_hashes: hashes,
            ring_key,
            ..RequestFeatures::default()
        }
    }

    /// The key of a session id (`x-session-id`, else the request's `user`), seeded by the
    /// model so that one id in two models is two sessions. The gateway and the simulator both
    /// hash it here.
    pub fn session_key(model: &str, id: &[u8]) -> u64 {
        let seed = kvgate_protocol::HashSeed::new(model, None, "session");
        xxhash_rust::xxh3::xxh3_64_with_seed(id, seed.0)
    }
}
