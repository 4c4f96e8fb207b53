//! The draft-model drafter: a smaller model with the target's vocabulary, run by the CPU
//! backend's kernels on the target's threads (the two never compute at once), with a paged KV
//! cache of its own. Each request's draft state (the tokens its cache holds) lasts between
//! steps: a step cuts back what the target rejected, feeds only what is new (the kept tokens and
//! the target's own), then drafts one token per position, every request of the step in one
//! batch. Drafts are the draft model's argmax: a point mass, which exact verification handles
//! under any sampling.

use super::forward::Forward;
use super::kv_cache::KvCache;
use super::weights::Weights;
use crate::backend::BatchSlice;
use crate::kv::BlockId;
use crate::model::{LlamaParams, ModelFile};
use crate::request::{RequestId, RequestMap, SamplingParams};
use crate::sample::argmax;
use crate::spec::{Draft, DraftAsk, Drafter};
use std::path::Path;
use std::sync::Arc;

/// Most tokens a catch-up pass computes at once (a new request's prompt comes in pieces), so
/// that a burst of long prompts does not grow the buffers without bound.
const CATCH_UP_TOKENS: usize = 2048;

/// What the draft model must share with the target.
pub struct Target<'a> {
    pub params: &'a LlamaParams,
    /// `tokenizer.ggml.tokens` (empty when the file does not list them).
    pub tokens: &'a [String],
    pub bytes_per_token: usize,
    pub forward: &'a Forward,
    pub block_size: usize,
}

pub struct ModelDrafter {
    forward: Forward,
    block_size: usize,
    num_blocks: usize,
    free: Vec<BlockId>,
    seqs: RequestMap<DraftSeq>,
    /// Bumped by every batch; a sequence's `used` orders evictions.
    clock: u64,
    cost_per_token: f64,
    params: SamplingParams,
}

#[derive(Default)]
struct DraftSeq {
    /// The tokens whose K/V the draft cache holds, from position 0 (then, during a batch, the
    /// ones being fed).
    tokens: Vec<u32>,
    blocks: Vec<BlockId>,
    num_prompt_tokens: usize,
    used: u64,
}

impl ModelDrafter {
    /// Loads the draft model at `path` with a KV cache of `kv_cache_bytes`, or says why not.
    pub fn load(path: &Path, target: Target<'_>, kv_cache_bytes: usize) -> Result<Self, String> {
        let named = |e: &dyn std::fmt::Display| format!("draft model {}: {e}", path.display());
        let model = ModelFile::open(path).map_err(|e| named(&e))?;
        let (mine, theirs) = (model.params.vocab_size, target.params.vocab_size);
        if mine != theirs {
            return Err(named(&format!(
                "its vocabulary has {mine} tokens, the target's {theirs}: a draft model must share the target's tokenizer"
            )));
        }
        if let Ok(mine) = model.gguf.get_strings("tokenizer.ggml.tokens") {
            let theirs = target.tokens;
            if let Some(i) = mine.iter().zip(theirs).position(|(a, b)| a != b) {
                return Err(named(&format!(
                    "its vocabulary differs from the target's at token {i} ({:?} against {:?}): a draft model must share the target's tokenizer",
                    mine[i], theirs[i]
                )));
            }
        }
        let weights = Weights::load(path, &model.gguf, &model.params).map_err(|e| named(&e))?;
        let p = &model.params;
        let kv_dim = p.kv_heads * p.head_dim;
        let per_block = KvCache::bytes_per_token(p.layers, kv_dim) * target.block_size;
        let num_blocks = kv_cache_bytes / per_block.max(1);
        if num_blocks == 0 {
            return Err(named(&format!(
                "a KV cache of {kv_cache_bytes} bytes is below one block of {per_block} bytes"
            )));
        }
        let cost_per_token =
            weights.bytes_per_token() as f64 / target.bytes_per_token.max(1) as f64;
        let kv = KvCache::new(p.layers, num_blocks, target.block_size, kv_dim);
        let forward = Forward::new(
            Arc::new(weights),
            kv,
            target.forward.isa(),
            Arc::clone(target.forward.team()),
        );
        Ok(ModelDrafter::with_forward(
            forward,
            target.block_size,
            num_blocks,
            cost_per_token,
        ))
    }

    fn with_forward(
        forward: Forward,
        block_size: usize,
        num_blocks: usize,
        cost_per_token: f64,
    ) -> Self {
        ModelDrafter {
            forward,
            block_size,
            num_blocks,
            // Block 0 is the cache's null block.
            free: (1..=num_blocks as BlockId).rev().collect(),
            seqs: RequestMap::default(),
            clock: 0,
            cost_per_token,
            params: SamplingParams::default(),
        }
    }

    /// Tokens the draft cache holds for `id` (for tests).
    pub fn cached_tokens(&self, id: RequestId) -> usize {
        self.seqs.get(&id).map_or(0, |s| s.tokens.len())
    }

    /// Blocks not held by any request (for tests).
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    pub fn total_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Cuts `seq`'s cache back to its first `len` tokens.
    fn cut(&mut self, seq: &mut DraftSeq, len: usize) {
        seq.tokens.truncate(len);
        let keep = len.div_ceil(self.block_size);
        self.free
            .extend(seq.blocks.drain(keep.min(seq.blocks.len())..));
    }

    /// Gives `seq` blocks for `tokens` positions, evicting requests this batch does not
    /// draft for, least recently drafted first. False when even that is not enough.
    fn reserve(&mut self, seq: &mut DraftSeq, tokens: usize) -> bool {
        let need = tokens.div_ceil(self.block_size);
        if need > self.num_blocks {
            return false;
        }
        while seq.blocks.len() < need {
            if let Some(block) = self.free.pop() {
                seq.blocks.push(block);
                continue;
            }
            let clock = self.clock;
            let idle = self
                .seqs
                .iter()
                .filter(|(_, s)| s.used < clock)
                .min_by_key(|(_, s)| s.used)
                .map(|(&id, _)| id);
            let Some(mut evicted) = idle.and_then(|id| self.seqs.remove(&id)) else {
                return false;
            };
            self.cut(&mut evicted, 0);
        }
        true
    }

    /// Brings `ask`'s sequence up to its context, less what is new; returns where the new part
    /// starts, or `None` when its cache cannot hold the draft.
    fn prepare(&mut self, ask: &DraftAsk<'_>) -> Option<usize> {
        let mut seq = self.seqs.remove(&ask.id).unwrap_or_default();
        // At least the last token is fed again: its logits give the first draft token.
        let same = seq
            .tokens
            .iter()
            .zip(ask.context)
            .take_while(|(a, b)| a == b)
            .count()
            .min(ask.context.len() - 1);
        self.cut(&mut seq, same);
        if !self.reserve(&mut seq, ask.context.len() + ask.k - 1) {
            self.cut(&mut seq, 0);
            return None;
        }
        seq.tokens.extend_from_slice(&ask.context[same..]);
        seq.num_prompt_tokens = ask.num_prompt_tokens;
        seq.used = self.clock;
        self.seqs.insert(ask.id, seq);
        Some(same)
    }

    /// One forward pass over `(request, start, len)` slices of the sequences' tokens; the
    /// argmax after each slice that reaches its sequence's end, by slice.
    fn run(&mut self, slices: &[(RequestId, usize, usize)]) -> Vec<Option<u32>> {
        let batch: Vec<BatchSlice<'_>> = slices
            .iter()
            .map(|&(id, start, len)| {
                let seq = &self.seqs[&id];
                BatchSlice {
                    id,
                    tokens: &seq.tokens,
                    start,
                    len,
                    block_table: &seq.blocks,
                    samples: start + len == seq.tokens.len(),
                    draft: 0,
                    params: &self.params,
                    num_output_tokens: seq.tokens.len().saturating_sub(seq.num_prompt_tokens),
                }
            })
            .collect();
        let mut next = vec![None; slices.len()];
        for (i, row) in self.forward.run(&batch).iter() {
            next[i] = Some(argmax(row));
        }
        next
    }
}

impl Drafter for ModelDrafter {
    fn propose(&mut self, context: &[u32], k: usize) -> Vec<u32> {
        // An anonymous request: drafted for, then forgotten.
        let id = RequestId::MAX;
        let draft = self.propose_batch(&[DraftAsk {
            id,
            context,
            num_prompt_tokens: context.len(),
            k,
        }]);
        self.forget(id);
        draft.into_iter().next().unwrap_or_default().tokens
    }

    fn propose_batch(&mut self, asks: &[DraftAsk<'_>]) -> Vec<Draft> {
        self.clock += 1;
        let mut drafts = vec![Vec::new(); asks.len()];
        // (ask, next position to feed) of every request that drafts.
        let mut feeding: Vec<(usize, usize)> = Vec::new();
        for (a, ask) in asks.iter().enumerate() {
            if ask.k == 0 || ask.context.is_empty() {
                continue;
            }
            if let Some(start) = self.prepare(ask) {
                feeding.push((a, start));
            }
        }
        // Catch up on the new tokens, at most `CATCH_UP_TOKENS` a pass; a request's first
        // draft token comes from its last new one.
        while feeding.iter().any(|&(a, at)| at < asks[a].context.len()) {
            let mut budget = CATCH_UP_TOKENS;
            let mut slices = Vec::new();
            let mut owners = Vec::new();
            for (f, &(a, at)) in feeding.iter().enumerate() {
                let len = (asks[a].context.len() - at).min(budget);
                if len > 0 {
                    slices.push((asks[a].id, at, len));
                    owners.push(f);
                    budget -= len;
                }
            }
            let next = self.run(&slices);
            for ((&f, &(_, _, len)), token) in owners.iter().zip(&slices).zip(next) {
                let (a, at) = &mut feeding[f];
                *at += len;
                drafts[*a].extend(token);
            }
        }
        // Then one token per pass: each request feeds its last draft token until it has `k`.
        loop {
            let mut growing = Vec::new();
            let mut slices = Vec::new();
            for &(a, _) in &feeding {
                let (draft, id) = (&drafts[a], asks[a].id);
                if draft.is_empty() || draft.len() >= asks[a].k {
                    continue;
                }
                if let Some(seq) = self.seqs.get_mut(&id) {
                    seq.tokens.extend(draft.last());
                    slices.push((id, seq.tokens.len() - 1, 1));
                    growing.push(a);
                }
            }
            if growing.is_empty() {
                break;
            }
            for (&a, token) in growing.iter().zip(self.run(&slices)) {
                drafts[a].extend(token);
            }
        }
        drafts
            .into_iter()
            .map(|tokens| Draft { tokens, source: 0 })
            .collect()
    }

    fn cost_per_token(&self) -> f64 {
        self.cost_per_token
    }

    fn forget(&mut self, id: RequestId) {
        if let Some(mut seq) = self.seqs.remove(&id) {
            self.cut(&mut seq, 0);
        }
    }

    /// A copy with the same model and an empty cache of the same size, on the same threads
    /// (so used from the same thread as the original): it drafts the same tokens once it has
    /// caught up.
    fn clone_box(&self) -> Box<dyn Drafter> {
        let p = &self.forward.weights.params;
        let kv = KvCache::new(
            p.layers,
            self.num_blocks,
            self.block_size,
            p.kv_heads * p.head_dim,
        );
        let forward = Forward::new(
            Arc::clone(&self.forward.weights),
            kv,
            self.forward.isa(),
            Arc::clone(self.forward.team()),
        );
        Box::new(ModelDrafter::with_forward(
            forward,
            self.block_size,
            self.num_blocks,
            self.cost_per_token,
        ))
    }
}
