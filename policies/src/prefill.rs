//! Prefill work: how many prompt tokens a replica must compute before a request's first token.
//! Requests differ in length by orders of magnitude (long documents beside short chats), so
//! counting requests alone cannot tell a replica busy prefilling 30,000 tokens from one with
//! a few short decodes.

use crate::ReplicaView;

/// A prompt's length in tokens and in the unit the prefix index counts (blocks or chunks),
/// and how its recompute is counted.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PromptWork {
    tokens: u64,
    blocks: f64,
    /// The most of it any candidate holds, and what each token of that a replica would
    /// recompute counts besides itself.
    most_held: f64,
    recompute_penalty: f64,
}

impl PromptWork {
    pub fn new(tokens: u64, blocks: usize) -> Self {
        PromptWork {
            tokens,
            blocks: blocks as f64,
            most_held: 0.0,
            recompute_penalty: 0.0,
        }
    }

    /// Counts the tokens a replica would recompute, of the `most_held` blocks some candidate
    /// holds, `penalty` times more.
    pub fn with_recompute_penalty(self, most_held: f64, penalty: f64) -> Self {
        PromptWork {
            most_held,
            recompute_penalty: penalty.max(0.0),
            ..self
        }
    }

    /// Tokens left to prefill on a replica holding `held` of the prompt's leading blocks: the
    /// share of blocks it does not hold, applied to the prompt's tokens (off by at most the
    /// partial last block, which no replica holds).
    pub fn uncached(&self, held: f64) -> u64 {
        if self.blocks <= 0.0 {
            return self.tokens;
        }
        let share = (held / self.blocks).clamp(0.0, 1.0);
        (self.tokens as f64 * (1.0 - share)).round() as u64
    }

    /// The prefill ahead of this request's first token on `r`: its backlog and the part of
    /// the prompt it does not hold, that part's recompute of what another holds penalised.
    pub fn ahead_on(&self, r: &ReplicaView, held: f64) -> u64 {
        let recompute = self
            .uncached(held)
            .saturating_sub(self.uncached(self.most_held));
        let penalty = (recompute as f64 * self.recompute_penalty).round() as u64;
        r.prefill_backlog
            .saturating_add(self.uncached(held))
            .saturating_add(penalty)
    }

    /// The signal: `(least + prompt) / (work + prompt)`, 1 for the replica with the least work,
    /// at most 0.5 for one with a whole prompt's length more.
    pub fn relative(&self, least: u64, work: u64) -> f64 {
        let prompt = self.tokens.max(1) as f64;
        (least as f64 + prompt) / (work as f64 + prompt)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uncached_is_the_share_of_blocks_not_held() {
        let w = PromptWork::new(1_000, 10);
        assert_eq!(w.uncached(0.0), 1_000);
        assert_eq!(w.uncached(4.0), 600);
        assert_eq!(w.uncached(10.0), 0);
        // Shorter than one block: nothing can be held.
        assert_eq!(PromptWork::new(7, 0).uncached(0.0), 7);
    }

    #[test]
    fn relative_is_one_for_the_least_work_and_half_a_prompt_later() {
        let w = PromptWork::new(1_000, 10);
        assert_eq!(w.relative(300, 300), 1.0);
        assert_eq!(w.relative(300, 1_300), (300.0 + 1_000.0) / 2_300.0);
        assert!(w.relative(0, 1_000) == 0.5);
        // An empty prompt still compares backlogs.
        assert!(PromptWork::new(0, 0).relative(0, 10) < 0.1);
    }
}
