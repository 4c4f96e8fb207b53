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

use super::emit::emit;
use super::timing;
use super::{cannot_draft, Backend, BackendError, BatchOutput, BatchSlice, BlockCosts};
use crate::kv::BlockId;
use crate::model::ModelFile;
use crate::spec::{Drafter, Method, StepCosts};
use dot::Isa;
use draft::{ModelDrafter, Target};
use forward::Forward;
use kv_cache::KvCache;
use std::path::Path;
use std::sync::Arc;
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
        let sampled = emit(batch, logits.iter());
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

    fn block_costs(&mut self, _block_size: usize) -> Option<BlockCosts> {
        let (vocab, block_size) = (self.forward.weights.params.vocab_size, self.block_size);
        (self.num_blocks > 0).then_some(())?;
        timing::block_costs(self, vocab, block_size)
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

    fn step_costs(&mut self, max_tokens: usize) -> StepCosts {
        let (vocab, block_size) = (self.forward.weights.params.vocab_size, self.block_size);
        let free_blocks = self.num_blocks;
        timing::step_costs(self, vocab, block_size, free_blocks, max_tokens)
    }
}
