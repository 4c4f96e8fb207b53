//! The sim backend: no math, only timing. A step's duration comes from a [`Profile`], its
//! tokens from a hash of the sequence so far, so output is deterministic whatever the batch.
//! It never samples an end-of-sequence token: `max_tokens` ends generation. Its distribution is
//! a point mass on that token, so asked for logprobs it reports 0 for it and nothing else, and
//! a speculative draft is verified against it exactly (kept while it names the same tokens),
//! the step priced as one of all its tokens. With a profile that names its device-host link,
//! blocks can be offloaded: no bytes move, each copy out or back is priced by the block's
//! size over the link and added to the next step (no overlap with compute: conservative).

use super::profile::Profile;
use super::{cannot_draft, Backend, BackendError, BatchOutput, BatchSlice, BlockCosts, Sampled};
use crate::kv::BlockId;
use crate::sample::TokenLogprobs;
use crate::spec::{Drafter, Method, StepCosts};
use std::time::Duration;
use xxhash_rust::xxh3::xxh3_64_with_seed;

#[derive(Clone)]
pub struct SimBackend {
    profile: Profile,
    /// Tokens are drawn from `first_token..vocab_size` (skipping control tokens).
    first_token: u32,
    vocab_size: u32,
    /// A block's K/V in bytes, once an offload tier asked ([`Backend::block_costs`]).
    block_bytes: usize,
    /// Seconds of block copies since the last step, which the next step pays.
    copies_s: f64,
}

/// Tokens of context that seed the next token (bounded, so a step stays cheap).
const SEED_WINDOW: usize = 64;

impl SimBackend {
    pub fn new(profile: Profile, first_token: u32, vocab_size: u32) -> Self {
        SimBackend {
            profile,
            first_token,
            vocab_size: vocab_size.max(first_token + 1),
            block_bytes: 0,
            copies_s: 0.0,
        }
    }

    pub fn profile(&self) -> &Profile {
        &self.profile
    }

    /// The token that follows `tokens` under `seed`.
    pub fn next_token(&self, tokens: &[u32], seed: Option<u64>) -> u32 {
        let window = &tokens[tokens.len().saturating_sub(SEED_WINDOW)..];
        let mut bytes = [0u8; SEED_WINDOW * 4];
        for (chunk, t) in bytes.chunks_exact_mut(4).zip(window) {
            chunk.copy_from_slice(&t.to_le_bytes());
        }
        let seed = seed.unwrap_or(0) ^ (tokens.len() as u64).rotate_left(32);
        let span = u64::from(self.vocab_size - self.first_token);
        self.first_token + (xxh3_64_with_seed(&bytes[..window.len() * 4], seed) % span) as u32
    }
}

impl Backend for SimBackend {
    fn execute(&mut self, batch: &[BatchSlice<'_>]) -> Result<BatchOutput, BackendError> {
        let seconds = self
            .profile
            .step_seconds(batch.iter().map(|s| (s.start, s.len)))
            + std::mem::take(&mut self.copies_s);
        let mut sampled = Vec::new();
        for s in batch.iter().filter(|s| s.samples) {
            let end = s.start + s.len;
            let known = &s.tokens[..end];
            // Each drafted position's own token, then the next; kept while the draft agrees.
            for at in end - s.draft..=end {
                let token = self.next_token(&known[..at], s.params.seed);
                let logprobs = s.params.logprobs.map(|n| TokenLogprobs {
                    logprob: 0.0,
                    top: if n > 0 {
                        vec![(token, 0.0)]
                    } else {
                        Vec::new()
                    },
                });
                sampled.push(Sampled {
                    id: s.id,
                    token,
                    logprobs,
                });
                if known.get(at) != Some(&token) {
                    break;
                }
            }
        }
        Ok(BatchOutput {
            sampled,
            modelled_duration: Some(Duration::from_secs_f64(seconds)),
        })
    }

    fn kv_capacity_blocks(&self, block_size: usize) -> usize {
        self.profile.kv_capacity_tokens() / block_size.max(1)
    }

    /// From the profile: steps after a context of a typical chat turn.
    fn step_costs(&mut self, max_tokens: usize) -> StepCosts {
        const CONTEXT: usize = 1024;
        let points = StepCosts::sizes_to_measure(max_tokens)
            .into_iter()
            .map(|n| (n, self.profile.step_seconds(std::iter::once((CONTEXT, n)))))
            .collect();
        StepCosts::from_points(points).unwrap_or_else(|_| StepCosts::linear())
    }

    /// A block's share of a long prefill's step, against copying it over the link.
    fn block_costs(&mut self, block_size: usize) -> Option<BlockCosts> {
        const CHUNK_BLOCKS: usize = 128;
        let bytes = (block_size as f64 * self.profile.model.kv_bytes_per_token).ceil() as usize;
        let load_s = self.profile.host_copy_seconds(bytes)?;
        let chunk = block_size.max(1) * CHUNK_BLOCKS;
        let compute_s =
            self.profile.step_seconds(std::iter::once((0, chunk))) / CHUNK_BLOCKS as f64;
        self.block_bytes = bytes;
        Some(BlockCosts {
            compute_s,
            load_s,
            bytes,
            exports_bytes: false,
        })
    }

    fn export_block(&mut self, _id: BlockId) -> Option<Vec<u8>> {
        self.copies_s += self.profile.host_copy_seconds(self.block_bytes)?;
        Some(Vec::new())
    }

    fn import_block(&mut self, _id: BlockId, _data: &[u8]) -> Result<(), BackendError> {
        self.copies_s += self
            .profile
            .host_copy_seconds(self.block_bytes)
            .unwrap_or_default();
        Ok(())
    }

    fn drafter(&mut self, method: &Method) -> Result<Box<dyn Drafter>, String> {
        match method {
            Method::Modelled { acceptance } => {
                Ok(Box::new(SimDrafter::new(self.clone(), *acceptance)))
            }
            _ => Err(cannot_draft(method)),
        }
    }
}

/// A drafter for the sim backend at a chosen acceptance rate: it proposes the sim model's own
/// continuation (as for requests without a seed), each token replaced by a wrong one with
/// probability `1 - acceptance`, decided by a hash of the context so that runs repeat.
#[derive(Clone)]
pub struct SimDrafter {
    model: SimBackend,
    acceptance: f64,
}

impl SimDrafter {
    pub fn new(model: SimBackend, acceptance: f64) -> Self {
        SimDrafter {
            model,
            acceptance: acceptance.clamp(0.0, 1.0),
        }
    }
}

impl Drafter for SimDrafter {
    fn propose(&mut self, context: &[u32], k: usize) -> Vec<u32> {
        let mut known = context.to_vec();
        for _ in 0..k {
            let right = self.model.next_token(&known, None);
            let coin = self.model.next_token(&known, Some(0xD1CE)) - self.model.first_token;
            let span = self.model.vocab_size - self.model.first_token;
            let wrong = f64::from(coin) / f64::from(span) >= self.acceptance;
            known.push(if wrong {
                self.model.first_token + (right - self.model.first_token + 1) % span
            } else {
                right
            });
        }
        known.split_off(context.len())
    }

    fn clone_box(&self) -> Box<dyn Drafter> {
        Box::new(self.clone())
    }
}
