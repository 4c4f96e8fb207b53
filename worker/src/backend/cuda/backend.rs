//! The CUDA backend behind the engine's `Backend` trait.

use super::forward::Forward;
use super::gpu::Gpu;
use super::plan::{StepPlan, StepShape};
use super::weights::DeviceWeights;
use super::{CudaConfig, HEAD_DIMS, TOP_K_MAX};
use crate::backend::cpu::weights::Weights;
use crate::backend::emit::{emit, emit_from_best};
use crate::backend::timing;
use crate::backend::{Backend, BackendError, BatchOutput, BatchSlice, BlockCosts, Sampled};
use crate::kv::BlockId;
use crate::model::ModelFile;
use crate::sample::is_greedy;
use crate::spec::StepCosts;
use std::path::Path;
use std::sync::Arc;

/// Device memory kept out of the KV cache for the step buffers (attention scores take up to
/// 256 MiB of it).
const SCRATCH_RESERVE: usize = 1 << 30;

pub struct CudaBackend {
    forward: Forward,
    num_blocks: usize,
}

impl CudaBackend {
    /// The model at `path` on CUDA device `config.gpu`.
    #[cfg(feature = "cuda")]
    pub fn load(
        path: &Path,
        model: &ModelFile,
        config: &CudaConfig,
    ) -> Result<CudaBackend, String> {
        check(model, config)?;
        let gpu = super::device::CudaGpu::open(config.gpu, model.params.head_dim)?;
        CudaBackend::on(Arc::new(gpu), path, model, config)
    }

    /// The model at `path` on `gpu` (a device, or the test suite's emulator).
    pub fn on(
        gpu: Arc<dyn Gpu>,
        path: &Path,
        model: &ModelFile,
        config: &CudaConfig,
    ) -> Result<CudaBackend, String> {
        check(model, config)?;
        let p = &model.params;
        let host = Weights::load(path, &model.gguf, p).map_err(|e| e.to_string())?;
        let weights = DeviceWeights::upload(&gpu, &host)?;
        drop(host);
        let (free, total) = gpu.memory()?;
        let used = total - free;
        let budget = ((total as f64 * config.memory_utilization) as usize)
            .saturating_sub(used)
            .saturating_sub(SCRATCH_RESERVE);
        let per_block = p.layers * 2 * config.block_size * p.kv_heads * p.head_dim * 2;
        let num_blocks = budget / per_block.max(1);
        if num_blocks == 0 {
            return Err(format!(
                "no device memory left for the KV cache: {} of {} MiB in use, utilisation {}",
                used >> 20,
                total >> 20,
                config.memory_utilization
            ));
        }
        let forward = Forward::new(gpu, weights, num_blocks, config.block_size)?;
        Ok(CudaBackend {
            forward,
            num_blocks,
        })
    }

    /// The device's name and compute capability, for the log.
    pub fn describe(&self) -> String {
        self.forward.gpu().describe()
    }

    /// Decode-step shapes recorded as CUDA graphs so far.
    pub fn graphs(&self) -> usize {
        self.forward.graphs()
    }

    /// Bytes of weights a step reads.
    pub fn bytes_per_step(&self) -> usize {
        self.forward.weights.bytes_per_step
    }

    /// Runs a batch and returns the logits of the slices that sample (for tests and tools).
    pub fn logits(&mut self, batch: &[BatchSlice<'_>]) -> Result<Vec<(usize, Vec<f32>)>, String> {
        let plan = self.run(batch)?;
        let vocab = self.forward.weights.params.vocab_size;
        let values = self.forward.logits(plan.sample_rows.len())?;
        Ok(plan
            .sample_rows
            .iter()
            .zip(values.chunks_exact(vocab))
            .map(|(&(i, _), row)| (i, row.to_vec()))
            .collect())
    }

    /// Enqueues a batch without waiting for it (for timing the launches alone).
    pub fn enqueue(&mut self, batch: &[BatchSlice<'_>]) -> Result<(), String> {
        self.run(batch).map(|_| ())
    }

    /// Waits for everything enqueued.
    pub fn synchronize(&self) -> Result<(), String> {
        self.forward.synchronize()
    }

    fn run(&mut self, batch: &[BatchSlice<'_>]) -> Result<StepPlan, String> {
        let (block_size, rope) = (self.forward.block_size, self.forward.rope);
        // A decode step is padded to the size of a recorded graph.
        let pad_to = self
            .forward
            .graph_tokens(&StepShape::of(batch, block_size))
            .unwrap_or(0);
        let plan = StepPlan::padded(batch, block_size, rope, pad_to).map_err(|e| e.to_string())?;
        self.forward.run(&plan)?;
        Ok(plan)
    }

    fn block_range(&self, id: BlockId) -> Option<std::ops::Range<usize>> {
        let p = &self.forward.weights.params;
        let per_block = self.forward.block_size * p.kv_heads * p.head_dim;
        let block = id as usize;
        (block > 0 && block <= self.num_blocks).then(|| block * per_block..(block + 1) * per_block)
    }
}

fn check(model: &ModelFile, config: &CudaConfig) -> Result<(), String> {
    let p = &model.params;
    if !HEAD_DIMS.contains(&p.head_dim) {
        return Err(format!(
            "heads of {} dimensions: the cuda backend's attention takes {HEAD_DIMS:?}",
            p.head_dim
        ));
    }
    if !(config.memory_utilization > 0.0 && config.memory_utilization <= 1.0) {
        return Err(format!(
            "--gpu-memory-utilization must be in (0, 1], got {}",
            config.memory_utilization
        ));
    }
    if config.block_size == 0 {
        return Err("--block-size must be at least 1".into());
    }
    Ok(())
}

/// How a sampling row's token is chosen: as little of the row as that needs comes back.
#[derive(Clone, Copy, PartialEq)]
enum Pick {
    /// Greedy: the best token, picked on the device (4 bytes back).
    Argmax,
    /// Top-k of at most `TOP_K_MAX`: the row's best k picked on the device, drawn from on
    /// the host (8 bytes a token back).
    Best(usize),
    /// Log-probabilities, drafts, or sampling from more than `TOP_K_MAX` tokens: the whole
    /// logits row.
    Whole,
}

impl Pick {
    fn of(s: &BatchSlice<'_>) -> Pick {
        let k = s.params.top_k as usize;
        if s.draft > 0 || s.params.logprobs.is_some() {
            Pick::Whole
        } else if is_greedy(s.params) {
            Pick::Argmax
        } else if (1..=TOP_K_MAX).contains(&k) {
            Pick::Best(k)
        } else {
            Pick::Whole
        }
    }
}

fn failed(e: String) -> BackendError {
    BackendError::Failed(e)
}

impl CudaBackend {
    /// The tokens of a step's sampling rows (`(slice, row)` in batch order), each fetched
    /// the cheapest way its slice allows (see [`Pick`]).
    fn sample(
        &self,
        batch: &[BatchSlice<'_>],
        rows: &[(usize, usize)],
    ) -> Result<Vec<Sampled>, String> {
        let picks: Vec<Pick> = rows.iter().map(|&(i, _)| Pick::of(&batch[i])).collect();
        let argmax = if picks.contains(&Pick::Argmax) {
            self.forward.argmax(rows.len())?
        } else {
            Vec::new()
        };
        let best = if picks.iter().any(|p| matches!(p, Pick::Best(_))) {
            let choices: Vec<(usize, f32)> = rows
                .iter()
                .zip(&picks)
                .map(|(&(i, _), pick)| match pick {
                    Pick::Best(k) => (*k, batch[i].params.temperature),
                    _ => (0, 1.0),
                })
                .collect();
            self.forward.best(&choices)?
        } else {
            Vec::new()
        };
        let vocab = self.forward.weights.params.vocab_size;
        let whole = if picks.contains(&Pick::Whole) {
            self.forward.logits(rows.len())?
        } else {
            Vec::new()
        };
        let mut sampled = Vec::with_capacity(rows.len());
        let mut r = 0;
        while r < rows.len() {
            let i = rows[r].0;
            // A drafted slice has a row per drafted token and one more; others have one.
            let end = r + rows[r..].iter().take_while(|row| row.0 == i).count();
            let s = &batch[i];
            match picks[r] {
                Pick::Argmax => sampled.push(Sampled {
                    id: s.id,
                    token: argmax[r] as u32,
                    logprobs: None,
                }),
                Pick::Best(_) => sampled.push(emit_from_best(s, &best[r])),
                Pick::Whole => sampled.extend(emit(
                    batch,
                    (r..end).map(|j| (i, &whole[j * vocab..(j + 1) * vocab])),
                )),
            }
            r = end;
        }
        Ok(sampled)
    }
}

impl Backend for CudaBackend {
    fn execute(&mut self, batch: &[BatchSlice<'_>]) -> Result<BatchOutput, BackendError> {
        let plan = self.run(batch).map_err(failed)?;
        let sampled = if plan.sample_rows.is_empty() {
            self.synchronize().map_err(failed)?;
            Vec::new()
        } else {
            self.sample(batch, &plan.sample_rows).map_err(failed)?
        };
        Ok(BatchOutput {
            sampled,
            modelled_duration: None,
        })
    }

    fn kv_capacity_blocks(&self, block_size: usize) -> usize {
        if block_size == self.forward.block_size {
            self.num_blocks
        } else {
            0
        }
    }

    fn step_costs(&mut self, max_tokens: usize) -> StepCosts {
        let vocab = self.forward.weights.params.vocab_size;
        let (block_size, free_blocks) = (self.forward.block_size, self.num_blocks);
        timing::step_costs(self, vocab, block_size, free_blocks, max_tokens)
    }

    fn block_costs(&mut self, block_size: usize) -> Option<BlockCosts> {
        let vocab = self.forward.weights.params.vocab_size;
        timing::block_costs(self, vocab, block_size)
    }

    /// K then V of every layer, f16 little-endian: the CPU backend's export format.
    fn export_block(&mut self, id: BlockId) -> Option<Vec<u8>> {
        let range = self.block_range(id)?;
        let mut out = Vec::with_capacity(range.len() * 4 * self.forward.kv.len());
        for (k, v) in &self.forward.kv {
            for cache in [k, v] {
                let values: Vec<u16> = cache.read(range.start, range.len()).ok()?;
                out.extend(values.iter().flat_map(|x| x.to_le_bytes()));
            }
        }
        Some(out)
    }

    fn import_block(&mut self, id: BlockId, data: &[u8]) -> Result<(), BackendError> {
        let range = self
            .block_range(id)
            .ok_or_else(|| failed(format!("no block {id} in this cache")))?;
        let expected = range.len() * 4 * self.forward.kv.len();
        if data.len() != expected {
            return Err(failed(format!(
                "a block holds {expected} bytes here, not {}",
                data.len()
            )));
        }
        let values: Vec<u16> = data
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect();
        let mut chunks = values.chunks_exact(range.len());
        for (k, v) in &self.forward.kv {
            for cache in [k, v] {
                let src = chunks.next().ok_or_else(|| failed("short block".into()))?;
                cache.write(range.start, src).map_err(failed)?;
            }
        }
        Ok(())
    }
}
