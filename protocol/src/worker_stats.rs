//! The kvgate worker's `GET /stats`: written by the worker, read by its agent (and by tests
//! and operators). One type on both sides, so a field renamed on one is a compile error on the
//! other rather than a report with zeros.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct WorkerStats {
    /// The served model name.
    pub model: String,
    /// LoRA adapters resident now.
    pub adapters: Vec<String>,
    /// Adapter slots free (0 when the worker serves no adapters).
    pub adapter_slots_free: usize,
    /// Adapter slots in all (`--max-loras`; 0: no adapters).
    pub max_loras: usize,
    pub max_model_len: usize,
    pub engine: EngineStats,
    /// The sequence number of the last KV-event batch (0 before the first).
    pub kv_events_seq: u64,
}

/// The engine's counters, as of its last step.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EngineStats {
    pub running: usize,
    pub waiting: usize,
    pub kv_blocks_total: usize,
    pub kv_blocks_free: usize,
    /// Free blocks still holding a cached prefix (reusable until evicted).
    pub kv_blocks_cached: usize,
    pub block_size: usize,
    pub preemptions: u64,
    pub prompt_tokens: u64,
    pub cached_prompt_tokens: u64,
    pub generated_tokens: u64,
    pub steps: u64,
    /// Speculative decoding (all zero without it).
    #[serde(default)]
    pub spec: SpecStats,
    /// The offload tier (all zero without it).
    #[serde(default)]
    pub offload: OffloadStats,
}

/// The offload tier's contents and traffic.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct OffloadStats {
    pub capacity_bytes: u64,
    /// What loading a block back costs against computing it, as the backend timed it at
    /// start (`None` without a tier).
    pub load_cost: Option<f64>,
    pub blocks: u64,
    pub bytes: u64,
    /// Blocks evicted from the device pool and kept in the tier.
    pub offloaded_blocks: u64,
    /// Blocks loaded back into the pool for a prefix instead of computed again.
    pub loaded_blocks: u64,
    /// Blocks a prefill worker computed and this (decode) worker took into the tier.
    pub imported_blocks: u64,
    /// The disk tier below it (`None` without one).
    pub disk: Option<DiskTierStats>,
}

/// The disk tier's contents and traffic.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DiskTierStats {
    pub capacity_bytes: u64,
    /// What loading a block back from disk costs against computing it (a read timed at
    /// start, then the backend's load).
    pub load_cost: f64,
    pub blocks: u64,
    pub bytes: u64,
    /// Blocks the host tier evicted and the disk tier kept.
    pub stored_blocks: u64,
    /// Blocks loaded back from disk.
    pub loaded_blocks: u64,
    /// Files that did not read back whole (a checksum, a length, an I/O error): dropped, and
    /// their prefixes computed again.
    pub failed_reads: u64,
}

/// Most drafted tokens per request per step; acceptance is counted per position up to it.
pub const SPEC_POSITIONS: usize = 16;

/// Speculative decoding's counters, as vLLM's `spec_decode` metrics count them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct SpecStats {
    /// Drafts verified (one per request per step that drafted).
    pub drafts: u64,
    pub draft_tokens: u64,
    pub accepted_tokens: u64,
    /// Drafts whose token at each position (0 first) was accepted.
    pub accepted_per_pos: [u64; SPEC_POSITIONS],
}

impl SpecStats {
    /// Tokens a verified draft yields on average, the model's own token included (vLLM's mean
    /// acceptance length); `None` before the first draft.
    pub fn mean_acceptance_length(&self) -> Option<f64> {
        (self.drafts > 0).then(|| 1.0 + self.accepted_tokens as f64 / self.drafts as f64)
    }
}
