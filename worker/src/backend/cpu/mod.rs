//! The CPU backend: SmolLM2 (Llama family) from GGUF with quantised kernels, behind the
//! engine's `Backend` trait.

pub mod acts;
pub mod attention;
pub mod dot;
pub mod draft;
pub mod forward;
pub mod ggml_math;
pub mod kv_cache;
pub mod matmul;
pub mod quant;
pub mod team;
pub mod weights;

use super::{cannot_draft, Backend, BackendError, BatchOutput, BatchSlice, BlockCosts, Sampled};
use crate::kv::BlockId;
use crate::model::ModelFile;
use crate::request::SamplingParams;
use crate::sample::{logprobs, sample};
use crate::spec::{verify_logits, Drafter, Method, StepCosts};
use dot::Isa;
use draft::{ModelDrafter, Target};
use forward::Forward;
use kv_cache::KvCache;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use team::Team;
use weights::{WeightError, Weights};

#[derive(Debug, Clone)]
pub struct CpuConfig {
    /// Threads for the matrix products (1: the calling thread only).
    pub threads: usize,
    /// Memory for the KV cache.
    pub kv_cache_bytes: usize,
    pub block_size: usize,
}

pub struct CpuBackend {
    forward: Forward,
    num_blocks: usize,
    block_size: usize,
    /// The vocabulary's token strings, which a draft model must share.
    tokens: Vec<String>,
}

impl CpuBackend {
    pub fn load(
        path: &Path,
        model: &ModelFile,
        config: &CpuConfig,
    ) -> Result<CpuBackend, WeightError> {
        let weights = Weights::load(path, &model.gguf, &model.params)?;
        let p = &model.params;
        let kv_dim = p.kv_heads * p.head_dim;
        let per_block = KvCache::bytes_per_token(p.layers, kv_dim) * config.block_size;
        let num_blocks = (config.kv_cache_bytes / per_block.max(1)).max(1);
        let kv = KvCache::new(p.layers, num_blocks, config.block_size, kv_dim);
        let team = Team::new(config.threads).map_err(|e| {
            WeightError::Params(format!("cannot start {} threads: {e}", config.threads))
        })?;
        Ok(CpuBackend {
            forward: Forward::new(Arc::new(weights), kv, Isa::detect(), Arc::new(team)),
            num_blocks,
            block_size: config.block_size,
            tokens: model
                .gguf
                .get_strings("tokenizer.ggml.tokens")
                .map(|t| t.into_iter().map(str::to_owned).collect())
                .unwrap_or_default(),
        })
    }

    pub fn isa(&self) -> Isa {
        self.forward.isa()
    }

    /// Weight bytes read per decoded token at batch 1.
    pub fn bytes_per_token(&self) -> usize {
        self.forward.weights.bytes_per_token()
    }

    /// The model at `path` as a drafter for this one, on this backend's threads, with a KV
    /// cache of `kv_cache_bytes` of its own.
    pub fn draft_model(&self, path: &Path, kv_cache_bytes: usize) -> Result<ModelDrafter, String> {
        let target = Target {
            params: &self.forward.weights.params,
            tokens: &self.tokens,
            bytes_per_token: self.bytes_per_token(),
            forward: &self.forward,
            block_size: self.block_size,
        };
        ModelDrafter::load(path, target, kv_cache_bytes)
    }

    /// Runs a batch and returns the logits of the slices that sample (for tests and tools).
    pub fn logits(&mut self, batch: &[BatchSlice<'_>]) -> Vec<(usize, Vec<f32>)> {
        self.forward
            .run(batch)
            .iter()
            .map(|(i, l)| (i, l.to_vec()))
            .collect()
    }
}

impl Backend for CpuBackend {
    fn execute(&mut self, batch: &[BatchSlice<'_>]) -> Result<BatchOutput, BackendError> {
        let logits = self.forward.run(batch);
        let mut rows = logits.iter().peekable();
        let mut sampled = Vec::new();
        while let Some((i, first)) = rows.next() {
            let s = &batch[i];
            // Without a seed, the request id seeds the draws (different per request).
            let seed = s
                .params
                .seed
                .unwrap_or(s.id.wrapping_mul(0x2545_F491_4F6C_DD1D));
            let emit = |token: u32, row: &[f32]| Sampled {
                id: s.id,
                token,
                logprobs: s.params.logprobs.map(|n| logprobs(row, token, n as usize)),
            };
            if s.draft == 0 {
                // The common step: one row, one token, nothing to verify.
                sampled.push(emit(
                    sample(first, s.params, seed, s.num_output_tokens),
                    first,
                ));
                continue;
            }
            let mut slice_rows = vec![first];
            while let Some((_, row)) = rows.next_if(|(j, _)| *j == i) {
                slice_rows.push(row);
            }
            let end = s.start + s.len;
            let draft = &s.tokens[end + 1 - slice_rows.len()..end];
            let position = s.num_output_tokens.saturating_sub(s.draft);
            let verified = verify_logits(&slice_rows, draft, s.params, seed, position);
            sampled.extend(
                verified
                    .tokens
                    .iter()
                    .zip(&slice_rows)
                    .map(|(&token, row)| emit(token, row)),
            );
        }
        Ok(BatchOutput {
            sampled,
            modelled_duration: None,
        })
    }

    fn drafter(&mut self, method: &Method) -> Result<Box<dyn Drafter>, String> {
        match method {
            Method::Draft {
                model,
                kv_cache_bytes,
            } => Ok(Box::new(self.draft_model(model, *kv_cache_bytes)?)),
            _ => Err(cannot_draft(method)),
        }
    }

    /// Timed: a block's tokens computed as a prompt in the first block, against that block
    /// exported and imported again; the best of a few runs each.
    fn block_costs(&mut self, _block_size: usize) -> Option<BlockCosts> {
        const RUNS: usize = 3;
        if self.num_blocks == 0 {
            return None;
        }
        let vocab = self.forward.weights.params.vocab_size as u32;
        let tokens: Vec<u32> = (0..self.block_size as u32)
            .map(|i| (i * 7919 + 100) % vocab)
            .collect();
        let params = SamplingParams::default();
        let prompt = BatchSlice {
            id: 0,
            tokens: &tokens,
            start: 0,
            len: tokens.len(),
            block_table: &[1],
            samples: false,
            draft: 0,
            params: &params,
            num_output_tokens: 0,
        };
        let (mut compute, mut load, mut bytes) = (Duration::MAX, Duration::MAX, 0);
        for _ in 0..RUNS {
            let started = Instant::now();
            self.forward.run(&[prompt]);
            compute = compute.min(started.elapsed());
            let started = Instant::now();
            let data = self.export_block(1)?;
            bytes = data.len();
            self.import_block(1, &data).ok()?;
            load = load.min(started.elapsed());
        }
        Some(BlockCosts {
            compute_s: compute.as_secs_f64(),
            load_s: load.as_secs_f64(),
            bytes,
            exports_bytes: true,
        })
    }

    fn export_block(&mut self, id: BlockId) -> Option<Vec<u8>> {
        self.forward.kv.export(id as usize)
    }

    fn import_block(&mut self, id: BlockId, data: &[u8]) -> Result<(), BackendError> {
        self.forward
            .kv
            .import(id as usize, data)
            .map_err(BackendError::Failed)
    }

    fn kv_capacity_blocks(&self, block_size: usize) -> usize {
        if block_size == self.block_size {
            self.num_blocks
        } else {
            0
        }
    }

    /// Timed: verification steps of each size after a short context, in the blocks the
    /// engine has not handed out yet; the best of a few runs each, against machine noise.
    fn step_costs(&mut self, max_tokens: usize) -> StepCosts {
        const CONTEXT: usize = 128;
        const RUNS: usize = 2;
        let sizes = StepCosts::sizes_to_measure(max_tokens);
        let total = CONTEXT + sizes.last().copied().unwrap_or(1);
        let blocks = total.div_ceil(self.block_size);
        if blocks > self.num_blocks {
            return StepCosts::linear();
        }
        let vocab = self.forward.weights.params.vocab_size as u32;
        let tokens: Vec<u32> = (0..total as u32)
            .map(|i| (i * 7919 + 100) % vocab)
            .collect();
        let table: Vec<u32> = (1..=blocks as u32).collect();
        let params = SamplingParams::default();
        // The context as a prompt, then steps shaped as the engine's: one output token
        // already sampled, then the draft.
        let prompt = BatchSlice {
            id: 0,
            tokens: &tokens[..CONTEXT],
            start: 0,
            len: CONTEXT,
            block_table: &table,
            samples: false,
            draft: 0,
            params: &params,
            num_output_tokens: 0,
        };
        let step = |len: usize| BatchSlice {
            tokens: &tokens[..CONTEXT + len],
            start: CONTEXT,
            len,
            samples: true,
            draft: len - 1,
            num_output_tokens: len,
            ..prompt
        };
        self.forward.run(&[prompt]);
        let mut points = Vec::with_capacity(sizes.len());
        for n in sizes {
            let mut best = Duration::MAX;
            for _ in 0..RUNS {
                let started = Instant::now();
                if self.execute(&[step(n)]).is_err() {
                    return StepCosts::linear();
                }
                best = best.min(started.elapsed());
            }
            points.push((n, best.as_secs_f64()));
        }
        StepCosts::from_points(points).unwrap_or_else(|_| StepCosts::linear())
    }
}
