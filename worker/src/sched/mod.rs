//! Continuous batching (vLLM V1 semantics): every request has a number of computed tokens and
//! a target (all its known tokens); each step hands out tokens under a budget so requests catch
//! up. That one rule gives chunked prefill, decodes and prefix hits. Running requests go first;
//! waiting ones are admitted only if nothing was preempted in this step. When blocks run out,
//! the newest (FCFS) or least urgent (priority) running request is preempted by recompute: its
//! blocks are freed (their hashes stay cached) and it waits at the front of the queue.

use crate::kv::KvManager;
use crate::request::{Request, RequestId, RequestMap};
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SchedulingPolicy {
    Fcfs,
    /// Lower `priority` first, then arrival order.
    Priority,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SchedulerConfig {
    /// Tokens computed per step, all requests together.
    pub max_num_batched_tokens: usize,
    /// Requests running at once.
    pub max_num_seqs: usize,
    /// Most prompt tokens one request may compute in one step (0: up to the budget), so that
    /// one long prompt cannot take a whole step.
    pub long_prefill_token_threshold: usize,
    pub policy: SchedulingPolicy,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            max_num_batched_tokens: 2048,
            max_num_seqs: 256,
            long_prefill_token_threshold: 0,
            policy: SchedulingPolicy::Fcfs,
        }
    }
}

impl SchedulerConfig {
    /// Tokens a request with `pending` tokens to compute gets from `budget`.
    pub fn chunk(&self, pending: usize, budget: usize) -> usize {
        match self.long_prefill_token_threshold {
            // A decode (one pending token) is never capped by the threshold.
            t if t > 0 && pending > 1 => pending.min(budget).min(t),
            _ => pending.min(budget),
        }
    }
}

/// Part of one request computed in a step: tokens `start..start + len` of its sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slice {
    pub id: RequestId,
    pub start: usize,
    pub len: usize,
    /// The slice reaches the end of the known tokens: the step samples the next one.
    pub samples: bool,
    /// Of `len`, the speculative draft appended by the engine after scheduling (see
    /// [`crate::spec`]); the scheduler plans none.
    pub draft: usize,
}

/// What one step computes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepPlan {
    pub slices: Vec<Slice>,
    /// Requests preempted to make room in this step.
    pub preempted: Vec<RequestId>,
}

impl StepPlan {
    pub fn num_tokens(&self) -> usize {
        self.slices.iter().map(|s| s.len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.slices.is_empty()
    }
}

#[derive(Debug, Clone, Default)]
pub struct Scheduler {
    pub config: SchedulerConfig,
    waiting: VecDeque<RequestId>,
    running: Vec<RequestId>,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig) -> Self {
        Scheduler {
            config,
            waiting: VecDeque::new(),
            running: Vec::new(),
        }
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// Queues a new request.
    pub fn add(&mut self, id: RequestId, requests: &RequestMap<Request>) {
        self.enqueue(id, false, requests);
    }

    /// Forgets a request (finished or aborted).
    pub fn remove(&mut self, id: RequestId) {
        self.running.retain(|&r| r != id);
        self.waiting.retain(|&r| r != id);
    }

    /// Puts a request in the waiting queue: FCFS at the back (new) or front (preempted);
    /// priority in (priority, arrival) order.
    fn enqueue(&mut self, id: RequestId, preempted: bool, requests: &RequestMap<Request>) {
        match self.config.policy {
            SchedulingPolicy::Fcfs if preempted => self.waiting.push_front(id),
            SchedulingPolicy::Fcfs => self.waiting.push_back(id),
            SchedulingPolicy::Priority => {
                let key = |r: &RequestId| requests.get(r).map(|o| (o.priority, o.arrival));
                let mine = key(&id);
                let pos = self
                    .waiting
                    .iter()
                    .position(|w| key(w) > mine)
                    .unwrap_or(self.waiting.len());
                self.waiting.insert(pos, id);
            }
        }
    }

    /// The running request to preempt: the newest, or under the priority policy the least
    /// urgent (newest among equals).
    fn victim(&self, requests: &RequestMap<Request>) -> Option<usize> {
        match self.config.policy {
            SchedulingPolicy::Fcfs => self.running.len().checked_sub(1),
            SchedulingPolicy::Priority => (0..self.running.len()).max_by_key(|&i| {
                requests
                    .get(&self.running[i])
                    .map(|r| (r.priority, r.arrival))
            }),
        }
    }

    /// Plans one step.
    pub fn schedule(&mut self, requests: &mut RequestMap<Request>, kv: &KvManager) -> StepPlan {
        let mut plan = StepPlan::default();
        let mut budget = self.config.max_num_batched_tokens;

        // Running requests first, in order; when blocks run out, preempt until they fit.
        let mut i = 0;
        'running: while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let pending = requests.get(&id).map_or(0, Request::num_pending_tokens);
            let len = self.config.chunk(pending, budget);
            if len == 0 {
                i += 1;
                continue;
            }
            let mut fits = true;
            while !requests.get_mut(&id).is_some_and(|r| kv.allocate(r, len)) {
                let Some(v) = self.victim(requests) else {
                    break 'running;
                };
                let victim = self.running.remove(v);
                self.preempt(victim, requests, kv);
                plan.preempted.push(victim);
                if victim == id {
                    fits = false;
                    break;
                }
                if v < i {
                    // Already scheduled in this step: take its slice back.
                    i -= 1;
                    if let Some(pos) = plan.slices.iter().position(|s| s.id == victim) {
                        budget += plan.slices.remove(pos).len;
                    }
                }
            }
            if !fits {
                continue;
            }
            if let Some(req) = requests.get(&id) {
                plan.slices.push(slice(req, len));
            }
            budget -= len;
            i += 1;
        }

        // Then waiting requests, unless this step had to preempt.
        while plan.preempted.is_empty()
            && budget > 0
            && self.running.len() < self.config.max_num_seqs
        {
            let Some(&id) = self.waiting.front() else {
                break;
            };
            let Some(req) = requests.get_mut(&id) else {
                self.waiting.pop_front();
                continue;
            };
            kv.update_hashes(req);
            if req.num_computed_tokens == 0 {
                req.num_computed_tokens = kv.cached_prefix(req);
            }
            let len = self.config.chunk(req.num_pending_tokens(), budget);
            if !kv.allocate(req, len) {
                // No room: give back the cached-prefix blocks and wait for the next step.
                req.num_computed_tokens = 0;
                kv.free(req);
                break;
            }
            if req.num_cached_tokens.is_none() {
                req.num_cached_tokens = Some(req.num_computed_tokens.min(req.num_prompt_tokens));
            }
            self.waiting.pop_front();
            self.running.push(id);
            plan.slices.push(slice(req, len));
            budget -= len;
        }
        plan
    }

    fn preempt(&mut self, id: RequestId, requests: &mut RequestMap<Request>, kv: &KvManager) {
        if let Some(req) = requests.get_mut(&id) {
            kv.free(req);
            req.num_computed_tokens = 0;
            req.preemptions += 1;
        }
        self.enqueue(id, true, requests);
    }
}

fn slice(req: &Request, len: usize) -> Slice {
    let start = req.num_computed_tokens;
    Slice {
        id: req.id,
        start,
        len,
        samples: start + len == req.tokens.len(),
        draft: 0,
    }
}
