//! A request as the engine tracks it.

use crate::kv::KvBlocks;
use crate::spec::{Acceptance, SOURCES};

pub type RequestId = u64;

/// Spreads sequential request ids over a hash table's buckets with one multiplication
/// (Fibonacci hashing) instead of SipHash: the engine looks requests up several times per step.
#[derive(Debug, Default, Clone, Copy)]
pub struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_u64(&mut self, id: u64) {
        self.0 = id.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// Requests by id.
pub type RequestMap<V> =
    std::collections::HashMap<RequestId, V, std::hash::BuildHasherDefault<IdHasher>>;

/// How a request's output is produced and when it stops.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    pub max_tokens: u32,
    /// 0 means greedy.
    pub temperature: f32,
    pub top_p: f32,
    /// 0 means off.
    pub top_k: u32,
    pub seed: Option<u64>,
    /// Generation stops after any of these (besides the model's end-of-sequence tokens).
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// Number of top log-probabilities to return per token, if any.
    pub logprobs: Option<u32>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            max_tokens: 16,
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: None,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence or stop token.
    Stop,
    /// `max_tokens` or the context length reached.
    Length,
    /// Aborted (client gone, stop string matched by the server, or shutdown).
    Abort,
}

impl FinishReason {
    pub fn as_openai(self) -> &'static str {
        match self {
            FinishReason::Stop | FinishReason::Abort => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// A request in the engine: its tokens (prompt, then output), progress and KV blocks.
#[derive(Debug)]
pub struct Request {
    pub id: RequestId,
    pub tokens: Vec<u32>,
    pub num_prompt_tokens: usize,
    pub params: SamplingParams,
    /// Lower runs first under the priority policy.
    pub priority: i32,
    /// Arrival order, for FCFS.
    pub arrival: u64,
    /// Tokens whose KV is computed (or taken from the prefix cache).
    pub num_computed_tokens: usize,
    /// Prompt tokens served from the prefix cache at first admission (reported as
    /// `cached_tokens`).
    pub num_cached_tokens: Option<usize>,
    /// Hashes of the full blocks of `tokens`.
    pub block_hashes: Vec<u64>,
    pub kv: KvBlocks,
    pub preemptions: u32,
    /// How its speculative drafts have fared, per drafter source.
    pub acceptance: [Acceptance; SOURCES],
    /// The source of the draft in the step being computed.
    pub draft_source: usize,
}

impl Request {
    pub fn num_output_tokens(&self) -> usize {
        self.tokens.len() - self.num_prompt_tokens
    }

    /// Tokens still to compute before the next one can be sampled.
    pub fn num_pending_tokens(&self) -> usize {
        self.tokens.len() - self.num_computed_tokens
    }
}
