//! The engine as a step machine: `add_request`, `step`, `abort`. No clock and no I/O here, so
//! the server drives it in real time and a simulator drives many in virtual time.

mod offload;
mod speculate;
mod transfer;

use crate::backend::{Backend, BackendError, BatchSlice, Sampled};
use crate::kv::KvManager;
use crate::request::{FinishReason, Request, RequestId, RequestMap, SamplingParams};
use crate::sample::TokenLogprobs;
use crate::sched::{Scheduler, SchedulerConfig, StepPlan};
use crate::spec::{Drafter, SpecConfig, StepCosts};
use kvgate_protocol::kv_events::KvEvent;
use kvgate_protocol::HashSeed;
use speculate::Speculator;
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub block_size: usize,
    /// KV blocks; `None` takes what the backend has room for.
    pub num_blocks: Option<usize>,
    /// Prompt plus output, in tokens.
    pub max_model_len: usize,
    pub prefix_caching: bool,
    pub scheduler: SchedulerConfig,
    /// Seeds the block hashes (model name, adapter, salt): the gateway must use the same.
    pub hash_seed: HashSeed,
    /// The model's end-of-sequence tokens.
    pub eos_token_ids: Vec<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngineError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("the prompt has {len} tokens, but the maximum context length is {limit} tokens (prompt plus at least one output token)")]
    PromptTooLong { len: usize, limit: usize },
    #[error("the KV cache holds {tokens} tokens ({blocks} blocks of {block_size}), less than one request of the context length ({max_model_len} tokens): give it more memory or lower the context length to at most {tokens}")]
    CacheBelowContext {
        tokens: usize,
        blocks: usize,
        block_size: usize,
        max_model_len: usize,
    },
    #[error("request {0} already exists")]
    DuplicateId(RequestId),
}

/// A request to add.
#[derive(Debug, Clone)]
pub struct NewRequest {
    pub id: RequestId,
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    pub priority: i32,
}

/// A token produced for a request in a step.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenOutput {
    pub id: RequestId,
    pub token: u32,
    pub logprobs: Option<TokenLogprobs>,
    pub finished: Option<FinishReason>,
    pub num_prompt_tokens: usize,
    pub num_cached_tokens: usize,
    pub num_output_tokens: usize,
}

#[derive(Debug, Clone, Default)]
pub struct StepOutput {
    pub plan: StepPlan,
    pub tokens: Vec<TokenOutput>,
    pub modelled_duration: Option<Duration>,
    pub kv_events: Vec<KvEvent>,
}

/// Counters for `/stats` and `/metrics`.
pub use kvgate_protocol::worker_stats::EngineStats;

pub struct Engine<B: Backend> {
    config: EngineConfig,
    backend: B,
    kv: KvManager,
    sched: Scheduler,
    requests: RequestMap<Request>,
    arrivals: u64,
    stats: EngineStats,
    spec: Option<Speculator>,
    /// A block's compute and load costs, timed once, when an offload tier first needs them.
    block_costs: Option<crate::backend::BlockCosts>,
}

impl<B: Backend> Engine<B> {
    /// Refuses a KV cache that cannot hold one request of the context length (as vLLM does):
    /// such a request would be preempted whenever it outgrew the cache and never finish.
    pub fn new(config: EngineConfig, backend: B) -> Result<Self, EngineError> {
        let num_blocks = config
            .num_blocks
            .unwrap_or_else(|| backend.kv_capacity_blocks(config.block_size));
        let tokens = num_blocks.saturating_mul(config.block_size);
        if tokens < config.max_model_len {
            return Err(EngineError::CacheBelowContext {
                tokens,
                blocks: num_blocks,
                block_size: config.block_size,
                max_model_len: config.max_model_len,
            });
        }
        let kv = KvManager::new(
            num_blocks,
            config.block_size,
            config.hash_seed,
            config.prefix_caching,
        );
        let sched = Scheduler::new(config.scheduler.clone());
        Ok(Engine {
            config,
            backend,
            kv,
            sched,
            requests: RequestMap::default(),
            arrivals: 0,
            stats: EngineStats::default(),
            spec: None,
            block_costs: None,
        })
    }

    /// Turns speculative decoding on with `config`'s drafter (a draft model is loaded by the
    /// backend), weighing drafts by the backend's step costs (measured now, before the first
    /// request). Returns the costs, or why the drafter cannot run.
    pub fn enable_speculation(&mut self, config: SpecConfig) -> Result<&StepCosts, String> {
        let drafter = match config.drafter() {
            Some(drafter) => drafter,
            None => self.backend.drafter(&config.method)?,
        };
        Ok(self.enable_speculation_with(config, drafter))
    }

    /// As [`Engine::enable_speculation`], with the drafter given.
    pub fn enable_speculation_with(
        &mut self,
        config: SpecConfig,
        drafter: Box<dyn Drafter>,
    ) -> &StepCosts {
        let costs = self
            .backend
            .step_costs(self.config.scheduler.max_num_batched_tokens);
        self.enable_speculation_at(config, drafter, costs)
    }

    /// As [`Engine::enable_speculation`], with step costs given rather than measured (flat
    /// costs make every draft worth verifying: for tests and what-ifs).
    pub fn enable_speculation_at(
        &mut self,
        config: SpecConfig,
        drafter: Box<dyn Drafter>,
        costs: StepCosts,
    ) -> &StepCosts {
        self.spec
            .insert(Speculator::new(config, drafter, costs))
            .costs()
    }

    pub fn speculation(&self) -> Option<&SpecConfig> {
        self.spec.as_ref().map(Speculator::config)
    }

    /// An independent copy, down to its KV pool and every request's block table: to look
    /// ahead (step the copy) without touching the original.
    pub fn fork(&self) -> Engine<B>
    where
        B: Clone,
    {
        let kv = self.kv.fork();
        let requests = self
            .requests
            .iter()
            .map(|(&id, r)| {
                let copy = Request {
                    id: r.id,
                    tokens: r.tokens.clone(),
                    num_prompt_tokens: r.num_prompt_tokens,
                    params: r.params.clone(),
                    priority: r.priority,
                    arrival: r.arrival,
                    num_computed_tokens: r.num_computed_tokens,
                    num_cached_tokens: r.num_cached_tokens,
                    block_hashes: r.block_hashes.clone(),
                    kv: kv.adopt(&r.kv),
                    preemptions: r.preemptions,
                    acceptance: r.acceptance,
                    draft_source: r.draft_source,
                };
                (id, copy)
            })
            .collect();
        Engine {
            config: self.config.clone(),
            backend: self.backend.clone(),
            kv,
            sched: self.sched.clone(),
            requests,
            arrivals: self.arrivals,
            stats: self.stats.clone(),
            spec: self.spec.clone(),
            block_costs: self.block_costs,
        }
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    pub fn backend_mut(&mut self) -> &mut B {
        &mut self.backend
    }

    pub fn has_work(&self) -> bool {
        self.sched.has_work()
    }

    pub fn request(&self, id: RequestId) -> Option<&Request> {
        self.requests.get(&id)
    }

    /// Validates and queues a request. Every request fits the cache alone at its longest (see
    /// [`Engine::new`]), so a preempted one always runs again once the others are done.
    pub fn add_request(&mut self, new: NewRequest) -> Result<(), EngineError> {
        let len = new.prompt.len();
        if len == 0 {
            return Err(EngineError::EmptyPrompt);
        }
        if len >= self.config.max_model_len {
            return Err(EngineError::PromptTooLong {
                len,
                limit: self.config.max_model_len,
            });
        }
        if self.requests.contains_key(&new.id) {
            return Err(EngineError::DuplicateId(new.id));
        }
        self.arrivals += 1;
        let req = Request {
            id: new.id,
            num_prompt_tokens: len,
            tokens: new.prompt,
            params: new.params,
            priority: new.priority,
            arrival: self.arrivals,
            num_computed_tokens: 0,
            num_cached_tokens: None,
            block_hashes: Vec::new(),
            kv: self.kv.empty_blocks(),
            preemptions: 0,
            acceptance: Default::default(),
            draft_source: 0,
        };
        if let Some(spec) = &mut self.spec {
            spec.learn_prompt(&req.tokens);
        }
        self.requests.insert(req.id, req);
        self.sched.add(new.id, &self.requests);
        Ok(())
    }

    /// Removes a request at once; its blocks are free when this returns.
    pub fn abort(&mut self, id: RequestId) -> bool {
        self.sched.remove(id);
        if let Some(spec) = &mut self.spec {
            spec.forget(id);
        }
        self.requests.remove(&id).is_some()
    }

    /// Plans and computes one step.
    pub fn step(&mut self) -> Result<StepOutput, BackendError> {
        let mut plan = self.sched.schedule(&mut self.requests, &self.kv);
        self.stats.preemptions += plan.preempted.len() as u64;
        self.move_offloaded_blocks()?;
        if plan.is_empty() {
            return Ok(StepOutput {
                plan,
                kv_events: self.kv.take_events(),
                ..StepOutput::default()
            });
        }
        if let Some(spec) = &mut self.spec {
            let running = self.sched.num_running();
            spec.draft(
                &mut plan,
                &mut self.requests,
                &self.kv,
                &self.config,
                running,
            );
        }
        self.offload_evicted();
        let drafted = plan.slices.iter().any(|s| s.draft > 0);
        let batch: Vec<BatchSlice<'_>> = plan
            .slices
            .iter()
            .filter_map(|s| {
                let r = self.requests.get(&s.id)?;
                Some(BatchSlice {
                    id: s.id,
                    tokens: &r.tokens,
                    start: s.start,
                    len: s.len,
                    block_table: r.kv.ids(),
                    samples: s.samples,
                    draft: s.draft,
                    params: &r.params,
                    num_output_tokens: r.num_output_tokens(),
                })
            })
            .collect();
        let output = self.backend.execute(&batch);
        drop(batch);
        if drafted {
            Speculator::undraft(&plan, &mut self.requests);
        }
        let output = match output {
            Ok(output) => output,
            Err(e) => {
                Speculator::abandon(&plan, &mut self.requests, &self.kv);
                return Err(e);
            }
        };
        self.stats.steps += 1;
        let emitted = if drafted {
            emitted_per_request(&output.sampled)
        } else {
            RequestMap::default()
        };
        for s in &plan.slices {
            if let Some(req) = self.requests.get_mut(&s.id) {
                req.num_computed_tokens = s.start + s.len - s.draft;
                if let (Some(spec), true) = (&mut self.spec, s.draft > 0) {
                    let n = emitted.get(&s.id).copied().unwrap_or(0);
                    req.num_computed_tokens += spec.settle(s, n, req);
                    self.kv.truncate(req, req.num_computed_tokens);
                }
                self.kv.commit(req);
            }
        }
        let mut tokens = Vec::with_capacity(output.sampled.len());
        for sampled in output.sampled {
            if let Some(out) = self.append_token(sampled) {
                tokens.push(out);
            }
        }
        Ok(StepOutput {
            plan,
            tokens,
            modelled_duration: output.modelled_duration,
            kv_events: self.kv.take_events(),
        })
    }

    fn append_token(&mut self, sampled: Sampled) -> Option<TokenOutput> {
        let Sampled {
            id,
            token,
            logprobs,
        } = sampled;
        let req = self.requests.get_mut(&id)?;
        if req.num_output_tokens() == 0 {
            self.stats.prompt_tokens += req.num_prompt_tokens as u64;
            self.stats.cached_prompt_tokens += req.num_cached_tokens.unwrap_or(0) as u64;
        }
        req.tokens.push(token);
        self.stats.generated_tokens += 1;
        self.kv.update_hashes(req);
        let stop = !req.params.ignore_eos && self.config.eos_token_ids.contains(&token)
            || req.params.stop_token_ids.contains(&token);
        let finished = if stop {
            Some(FinishReason::Stop)
        } else if req.num_output_tokens() >= req.params.max_tokens as usize
            || req.tokens.len() >= self.config.max_model_len
        {
            Some(FinishReason::Length)
        } else {
            None
        };
        let out = TokenOutput {
            id,
            token,
            logprobs,
            finished,
            num_prompt_tokens: req.num_prompt_tokens,
            num_cached_tokens: req.num_cached_tokens.unwrap_or(0),
            num_output_tokens: req.num_output_tokens(),
        };
        if finished.is_some() {
            if let Some(spec) = &mut self.spec {
                spec.learn_output(req);
            }
            self.abort(id);
        }
        Some(out)
    }

    pub fn stats(&self) -> EngineStats {
        EngineStats {
            running: self.sched.num_running(),
            waiting: self.sched.num_waiting(),
            kv_blocks_total: self.kv.total_blocks(),
            kv_blocks_free: self.kv.free_blocks(),
            kv_blocks_cached: self.kv.cached_blocks(),
            block_size: self.kv.block_size(),
            spec: self
                .spec
                .as_ref()
                .map(|s| s.stats.clone())
                .unwrap_or_default(),
            ..self.stats.clone()
        }
    }

    /// Forgets every cached prefix; blocks in use stay with their requests.
    pub fn reset_prefix_cache(&mut self) {
        self.kv.clear_cache();
    }

    /// KV events not yet returned by a step.
    pub fn take_kv_events(&mut self) -> Vec<KvEvent> {
        self.kv.take_events()
    }

    /// Every cached block hash (for KV-event snapshots).
    pub fn cached_hashes(&self) -> Vec<u64> {
        self.kv.cached_hashes()
    }

    /// Every block hash the offload tier holds (for KV-event snapshots).
    pub fn offloaded_hashes(&self) -> Vec<u64> {
        self.kv.offloaded_hashes()
    }

    /// Every block hash the disk tier holds.
    pub fn disk_hashes(&self) -> Vec<u64> {
        self.kv.disk_hashes()
    }

    /// Checks the KV pool against every request's block table: for tests.
    pub fn check_kv(&self) -> Result<(), String> {
        self.kv.check(self.requests.values())
    }
}

/// Tokens each request got in a step.
fn emitted_per_request(sampled: &[Sampled]) -> RequestMap<usize> {
    let mut counts = RequestMap::default();
    for s in sampled {
        *counts.entry(s.id).or_insert(0) += 1;
    }
    counts
}
