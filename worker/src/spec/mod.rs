//! Speculative decoding: drafters propose the tokens a request is likely to generate next, and
//! the engine verifies them in one multi-token step. Only the drafters live here so far; the
//! engine's multi-token steps, the verifier and the flags are the rest of the work.

mod ngram;
mod suffix;
mod verify;

pub use ngram::{NgramDrafter, NgramSettings};
pub use suffix::{SuffixCache, MAX_CONTINUATION};
pub use verify::{verify_greedy, verify_logits, verify_sampled, DraftProbs, Verified};

/// Proposes the tokens likely to follow a request's context (its prompt and output so far).
pub trait Drafter {
    /// At most `k` tokens that may follow `context`; empty when it has no guess. The caller
    /// bounds `k` by the room the request has left (`max_tokens`, the model's context).
    fn propose(&mut self, context: &[u32], k: usize) -> Vec<u32>;
}
