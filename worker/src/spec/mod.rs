//! Speculative decoding: a drafter proposes the tokens a request is likely to generate next,
//! the engine appends them to the request's decode slice, the backend verifies them in one
//! multi-token step, and the engine keeps what was verified (and rolls the rest of the KV back).
//! How many drafted tokens a step verifies follows each request's running acceptance and the
//! backend's measured step costs ([`plan`]).

mod ngram;
pub mod plan;
mod suffix;
mod verify;

pub use ngram::{NgramDrafter, NgramSettings};
pub use plan::{Acceptance, StepCosts};
pub use suffix::{SuffixCache, SuffixDrafter, MAX_CONTINUATION};
pub use verify::{verify_logits, verify_sampled, DraftProbs, Verified};

use crate::request::RequestId;
use std::num::NonZeroUsize;
use std::path::PathBuf;

/// One request's turn to be drafted for.
#[derive(Debug, Clone, Copy)]
pub struct DraftAsk<'a> {
    pub id: RequestId,
    /// The request's prompt, then its output so far.
    pub context: &'a [u32],
    pub num_prompt_tokens: usize,
    /// Most tokens to propose.
    pub k: usize,
}

/// Sources a drafter tells apart (the suffix drafter: the request's own context, and what other
/// requests said), each of its own worth: a request keeps running rates per source.
pub const SOURCES: usize = 2;

/// Proposed tokens, and which of the drafter's sources they came from (below [`SOURCES`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Draft {
    pub tokens: Vec<u32>,
    pub source: usize,
}

/// Proposes the tokens likely to follow a request's context (its prompt and output so far).
pub trait Drafter: Send {
    /// At most `k` tokens that may follow `context`; empty when it has no guess. The caller
    /// bounds `k` by the room the request has left (`max_tokens`, the model's context).
    fn propose(&mut self, context: &[u32], k: usize) -> Vec<u32>;

    /// Drafts for a step's requests, in order (a draft model runs them as one batch and keeps
    /// each request's state between steps); by default one by one, all from source 0.
    fn propose_batch(&mut self, asks: &[DraftAsk<'_>]) -> Vec<Draft> {
        asks.iter()
            .map(|a| Draft {
                tokens: self.propose(a.context, a.k),
                source: 0,
            })
            .collect()
    }

    /// What drafting one token costs, relative to a one-token step of the target: the
    /// engine proposes no longer drafts than verifying them is worth with this on top.
    fn cost_per_token(&self) -> f64 {
        0.0
    }

    /// The request is gone (finished or aborted): what was kept for it can go.
    fn forget(&mut self, _id: RequestId) {}

    /// A request arrived with this prompt.
    fn learn_prompt(&mut self, _prompt: &[u32]) {}

    /// A request finished: its prompt's last tokens, then its whole output.
    fn learn_output(&mut self, _tokens: &[u32]) {}

    /// An independent copy (an engine's fork drafts alike).
    fn clone_box(&self) -> Box<dyn Drafter>;
}

/// Most tokens a step may draft for one request: verification cost grows with the draft, and
/// the engine's choice of lengths ([`plan`]) rarely wants more.
pub const MAX_SPEC_TOKENS: usize = kvgate_protocol::worker_stats::SPEC_POSITIONS;

/// Which drafter proposes.
#[derive(Debug, Clone, PartialEq)]
pub enum Method {
    /// Prompt lookup in the request's own context (vLLM's `ngram`).
    Ngram,
    /// Prompt lookup, then a suffix cache of every request's prompt and output.
    Suffix { entries: NonZeroUsize },
    /// A smaller model with the target's vocabulary, greedy, run by the target's backend with
    /// its own KV cache of `kv_cache_bytes`.
    Draft {
        model: PathBuf,
        kv_cache_bytes: usize,
    },
    /// The sim backend's drafts: its own model's continuation, each token right with
    /// probability `acceptance` (the share a workload's drafts would keep), for fleet
    /// experiments.
    Modelled { acceptance: f64 },
}

/// Speculation as configured: the drafter, its lengths, and when it stops.
#[derive(Debug, Clone, PartialEq)]
pub struct SpecConfig {
    pub method: Method,
    /// Most drafted tokens per request per step (`--spec-tokens`).
    pub num_tokens: usize,
    pub ngram: NgramSettings,
    /// Above this many running requests nothing is drafted; `None` leaves it to the step
    /// costs.
    pub max_batch: Option<usize>,
}

impl SpecConfig {
    pub fn new(
        method: Method,
        num_tokens: usize,
        ngram: NgramSettings,
        max_batch: Option<usize>,
    ) -> Result<Self, String> {
        if num_tokens == 0 || num_tokens > MAX_SPEC_TOKENS {
            return Err(format!(
                "the number of speculative tokens must be between 1 and {MAX_SPEC_TOKENS}, got {num_tokens}"
            ));
        }
        Ok(SpecConfig {
            method,
            num_tokens,
            ngram,
            max_batch,
        })
    }

    /// The drafter of a method that works on tokens alone (`None` for a draft model or
    /// modelled drafts: the backend runs those, see `Backend::drafter`).
    pub fn drafter(&self) -> Option<Box<dyn Drafter>> {
        match self.method {
            Method::Ngram => Some(Box::new(NgramDrafter::new(self.ngram))),
            Method::Suffix { entries } => Some(Box::new(SuffixDrafter::new(self.ngram, entries))),
            Method::Draft { .. } | Method::Modelled { .. } => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draft_lengths_out_of_range_are_refused_with_the_range() {
        let ngram = NgramSettings::new(2, 4).unwrap();
        for bad in [0, MAX_SPEC_TOKENS + 1] {
            let e = SpecConfig::new(Method::Ngram, bad, ngram, None).unwrap_err();
            assert!(
                e.contains("between 1 and 16") && e.contains(&bad.to_string()),
                "{e}"
            );
        }
        assert!(SpecConfig::new(Method::Ngram, MAX_SPEC_TOKENS, ngram, None).is_ok());
    }
}
