//! The sim backend: no math, only timing. A step's duration comes from a [`Profile`], its
//! tokens from a hash of the sequence so far, so output is deterministic whatever the batch.
//! It never samples an end-of-sequence token: `max_tokens` ends generation. Its distribution is
//! a point mass on that token, so asked for logprobs it reports 0 for it and nothing else.

use super::profile::Profile;
use super::{Backend, BackendError, BatchOutput, BatchSlice, Sampled};
use crate::sample::TokenLogprobs;
use std::time::Duration;
use xxhash_rust::xxh3::xxh3_64_with_seed;

#[derive(Clone)]
pub struct SimBackend {
    profile: Profile,
    /// Tokens are drawn from `first_token..vocab_size` (skipping control tokens).
    first_token: u32,
    vocab_size: u32,
}

/// Tokens of context that seed the next token (bounded, so a step stays cheap).
const SEED_WINDOW: usize = 64;

impl SimBackend {
    pub fn new(profile: Profile, first_token: u32, vocab_size: u32) -> Self {
        SimBackend {
            profile,
            first_token,
            vocab_size: vocab_size.max(first_token + 1),
        }
    }

    pub fn profile(&self) -> &Profile {
        &self.profile
    }

    fn token(&self, slice: &BatchSlice<'_>) -> u32 {
        let tokens = slice.tokens;
        let window = &tokens[tokens.len().saturating_sub(SEED_WINDOW)..];
        let mut bytes = [0u8; SEED_WINDOW * 4];
        for (chunk, t) in bytes.chunks_exact_mut(4).zip(window) {
            chunk.copy_from_slice(&t.to_le_bytes());
        }
        let seed = slice.params.seed.unwrap_or(0) ^ (tokens.len() as u64).rotate_left(32);
        let span = u64::from(self.vocab_size - self.first_token);
        self.first_token + (xxh3_64_with_seed(&bytes[..window.len() * 4], seed) % span) as u32
    }
}

impl Backend for SimBackend {
    fn execute(&mut self, batch: &[BatchSlice<'_>]) -> Result<BatchOutput, BackendError> {
        if batch.iter().any(|s| s.draft > 0) {
            return Err(BackendError::Failed(
                "the sim backend does not verify speculative drafts yet".into(),
            ));
        }
        let seconds = self
            .profile
            .step_seconds(batch.iter().map(|s| (s.start, s.len)));
        let sampled = batch
            .iter()
            .filter(|s| s.samples)
            .map(|s| {
                let token = self.token(s);
                let logprobs = s.params.logprobs.map(|n| TokenLogprobs {
                    logprob: 0.0,
                    top: if n > 0 {
                        vec![(token, 0.0)]
                    } else {
                        Vec::new()
                    },
                });
                Sampled {
                    id: s.id,
                    token,
                    logprobs,
                }
            })
            .collect();
        Ok(BatchOutput {
            sampled,
            modelled_duration: Some(Duration::from_secs_f64(seconds)),
        })
    }

    fn kv_capacity_blocks(&self, block_size: usize) -> usize {
        self.profile.kv_capacity_tokens() / block_size.max(1)
    }
}
