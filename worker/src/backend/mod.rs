//! The backend computes a planned step: it runs the model over the step's token slices
//! (reading and writing KV through the block tables) and samples a token for every slice that
//! reaches the end of its request's known tokens.

pub mod cpu;
pub mod cuda;
pub mod emit;
pub mod profile;
pub mod sim;
pub mod timing;

use crate::kv::BlockId;
use crate::request::{RequestId, SamplingParams};
use crate::sample::TokenLogprobs;
use crate::spec::{Drafter, Method, StepCosts};
use std::time::Duration;

/// One request's part of a step.
#[derive(Debug, Clone, Copy)]
pub struct BatchSlice<'a> {
    pub id: RequestId,
    /// All the request's known tokens; this step computes `tokens[start..start + len]`.
    pub tokens: &'a [u32],
    pub start: usize,
    pub len: usize,
    pub block_table: &'a [BlockId],
    /// Sample the next token after this slice.
    pub samples: bool,
    /// With `samples`: the slice's last `draft` tokens are a deterministic speculative draft
    /// (fewer than `len`), verified against the model at those positions (greedy, or by
    /// rejection sampling under the request's sampling); the step emits the draft's kept tokens
    /// and the model's next one.
    pub draft: usize,
    pub params: &'a SamplingParams,
    /// Output tokens in `tokens`, this slice's draft included: the first drafted position
    /// (or the sampled one, without a draft) is output position `num_output_tokens - draft`.
    pub num_output_tokens: usize,
}

/// A token sampled for a request, with its log-probabilities when the request asks for them.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    pub id: RequestId,
    pub token: u32,
    pub logprobs: Option<TokenLogprobs>,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct BatchOutput {
    /// For every slice that samples, in batch order: its token, or with a draft the draft's
    /// kept tokens and the model's next one.
    pub sampled: Vec<Sampled>,
    /// How long the step takes on modelled hardware (the sim backend); `None` when the
    /// backend really computed it.
    pub modelled_duration: Option<Duration>,
}

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("backend failed: {0}")]
    Failed(String),
}

pub trait Backend {
    /// Computes one step.
    fn execute(&mut self, batch: &[BatchSlice<'_>]) -> Result<BatchOutput, BackendError>;

    /// KV blocks of `block_size` tokens this backend has room for.
    fn kv_capacity_blocks(&self, block_size: usize) -> usize;

    /// What a step of 1 to `max_tokens` tokens costs, relative to one token, for speculative
    /// decoding to weigh a draft's verification. Called before the first step, when the KV
    /// cache holds nothing. A backend that cannot tell says linear, and nothing is drafted.
    fn step_costs(&mut self, _max_tokens: usize) -> StepCosts {
        StepCosts::linear()
    }

    /// The drafter of a method this backend runs itself (a draft model, the sim backend's
    /// modelled drafts), or why it cannot.
    fn drafter(&mut self, method: &Method) -> Result<Box<dyn Drafter>, String> {
        Err(cannot_draft(method))
    }

    /// What computing a block of `block_size` tokens and loading its K/V back from host
    /// memory each cost, measured (or modelled) before the first request, and its size;
    /// `None` from a backend that holds no K/V to move (then nothing is offloaded).
    fn block_costs(&mut self, _block_size: usize) -> Option<BlockCosts> {
        None
    }

    /// Block `id`'s K/V as bytes, to keep outside the pool (the offload tier, a transfer);
    /// `None` from a backend that holds no K/V to move. A backend that only models K/V gives
    /// no bytes (the tier counts [`BlockCosts::bytes`]) and prices the copy.
    fn export_block(&mut self, _id: BlockId) -> Option<Vec<u8>> {
        None
    }

    /// Writes bytes [`Backend::export_block`] gave into block `id`.
    fn import_block(&mut self, id: BlockId, _data: &[u8]) -> Result<(), BackendError> {
        Err(BackendError::Failed(format!(
            "block {id}: this backend cannot import K/V"
        )))
    }
}

/// Why a backend cannot run `method`'s drafter.
pub fn cannot_draft(method: &Method) -> String {
    match method {
        Method::Draft { model, .. } => format!(
            "{}: this backend cannot run a draft model (the cpu backend can)",
            model.display()
        ),
        Method::Modelled { .. } => {
            "modelled drafts (--spec-method sim) need the sim backend: this one drafts for real"
                .into()
        }
        Method::Ngram | Method::Suffix { .. } => {
            format!("{method:?} drafts on tokens alone: the engine makes it, not the backend")
        }
    }
}

impl Backend for Box<dyn Backend + Send> {
    fn execute(&mut self, batch: &[BatchSlice<'_>]) -> Result<BatchOutput, BackendError> {
        (**self).execute(batch)
    }

    fn kv_capacity_blocks(&self, block_size: usize) -> usize {
        (**self).kv_capacity_blocks(block_size)
    }

    fn step_costs(&mut self, max_tokens: usize) -> StepCosts {
        (**self).step_costs(max_tokens)
    }

    fn drafter(&mut self, method: &Method) -> Result<Box<dyn Drafter>, String> {
        (**self).drafter(method)
    }

    fn block_costs(&mut self, block_size: usize) -> Option<BlockCosts> {
        (**self).block_costs(block_size)
    }

    fn export_block(&mut self, id: BlockId) -> Option<Vec<u8>> {
        (**self).export_block(id)
    }

    fn import_block(&mut self, id: BlockId, data: &[u8]) -> Result<(), BackendError> {
        (**self).import_block(id, data)
    }
}

/// One block's costs, in seconds: computing its tokens, and importing its K/V exported
/// before; and its K/V's size in bytes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockCosts {
    pub compute_s: f64,
    pub load_s: f64,
    pub bytes: usize,
    /// Whether an export carries the K/V's bytes (false: the copy is only modelled, and
    /// there is nothing to write to disk).
    pub exports_bytes: bool,
}

impl BlockCosts {
    /// Loading a block back from host memory against computing it.
    pub fn load_cost(&self) -> f64 {
        self.load_s / self.compute_s.max(1e-9)
    }

    /// The same, with `read_s` first to bring the block's bytes into memory.
    pub fn load_cost_after(&self, read_s: f64) -> f64 {
        (self.load_s + read_s) / self.compute_s.max(1e-9)
    }
}
