//! The engine's side of speculative decoding. After the scheduler has planned a step, drafts
//! are appended to its decode slices where verifying them pays (under the step budget and only
//! with free blocks: a draft never preempts anyone); the draft tokens sit at the end of the
//! request's tokens for the step alone. Afterwards they are taken back out, the tokens the
//! backend kept are appended like any other, and the KV of rejected positions is given back.

use super::EngineConfig;
use crate::kv::KvManager;
use crate::request::{Request, RequestId, RequestMap};
use crate::sched::{Slice, StepPlan};
use crate::spec::plan::{choose, Offer, Rate};
use crate::spec::{Acceptance, DraftAsk, Drafter, SpecConfig, StepCosts, SOURCES};
use kvgate_protocol::worker_stats::SpecStats;

/// The engine-wide acceptance rates (of a draft's first token, and of later ones) start at this,
/// as if seen `ENGINE_PRIOR_WEIGHT` times; a request's own start at the engine-wide ones, as if
/// seen `REQUEST_PRIOR_WEIGHT` times.
const PRIOR: f64 = 0.5;
const ENGINE_PRIOR_WEIGHT: f64 = 2.0;
const REQUEST_PRIOR_WEIGHT: f64 = 4.0;
/// Optimism while the engine has seen few drafts, `EXPLORE / sqrt(seen + 1)` on top of each
/// rate: without it, a machine whose two-token step costs more than a prior-weighted draft
/// earns would never draft (and one that drafts single tokens never try longer drafts), and
/// so never learn that its traffic drafts well.
const EXPLORE: f64 = 0.5;

pub(super) struct Speculator {
    config: SpecConfig,
    drafter: Box<dyn Drafter>,
    costs: StepCosts,
    /// Engine-wide, per drafter source.
    acceptance: [Acceptance; SOURCES],
    pub(super) stats: SpecStats,
}

impl Clone for Speculator {
    fn clone(&self) -> Self {
        Speculator {
            config: self.config.clone(),
            drafter: self.drafter.clone_box(),
            costs: self.costs.clone(),
            acceptance: self.acceptance,
            stats: self.stats.clone(),
        }
    }
}

/// A decode slice's draft, before the choice of how much of it to verify.
struct Candidate {
    slice: usize,
    tokens: Vec<u32>,
    source: usize,
}

impl Speculator {
    pub(super) fn new(config: SpecConfig, drafter: Box<dyn Drafter>, costs: StepCosts) -> Self {
        Speculator {
            drafter,
            config,
            costs,
            acceptance: Default::default(),
            stats: SpecStats::default(),
        }
    }

    pub(super) fn config(&self) -> &SpecConfig {
        &self.config
    }

    pub(super) fn costs(&self) -> &StepCosts {
        &self.costs
    }

    pub(super) fn learn_prompt(&mut self, prompt: &[u32]) {
        self.drafter.learn_prompt(prompt);
    }

    pub(super) fn forget(&mut self, id: RequestId) {
        self.drafter.forget(id);
    }

    /// A request finished with these tokens (prompt, then output).
    pub(super) fn learn_output(&mut self, req: &Request) {
        let from = req.num_prompt_tokens.saturating_sub(self.config.ngram.max);
        self.drafter.learn_output(&req.tokens[from..]);
    }

    /// Appends drafts to the plan's decode slices where verification pays.
    pub(super) fn draft(
        &mut self,
        plan: &mut StepPlan,
        requests: &mut RequestMap<Request>,
        kv: &KvManager,
        engine: &EngineConfig,
        running: usize,
    ) {
        if self.config.max_batch.is_some_and(|max| running > max) {
            return;
        }
        let base_tokens = plan.num_tokens();
        let room = engine
            .scheduler
            .max_num_batched_tokens
            .saturating_sub(base_tokens);
        let base_samples = plan.slices.iter().filter(|s| s.samples).count();
        // Later tokens start as likely as first ones (the geometric model) until runs are seen.
        let optimistic = |rate: &Rate, prior: f64| {
            (rate.rate(prior, ENGINE_PRIOR_WEIGHT) + EXPLORE / (rate.seen() + 1.0).sqrt()).min(1.0)
        };
        let shared: [(f64, f64); SOURCES] = std::array::from_fn(|source| {
            let a = &self.acceptance[source];
            let first = optimistic(&a.first, PRIOR);
            (first, optimistic(&a.then, first))
        });
        // A request's rates for drafts from `source`.
        let offer = |req: &Request, source: usize, len: usize| {
            let (first, then) = shared[source];
            let a = &req.acceptance[source];
            Offer {
                first: a.first.rate(first, REQUEST_PRIOR_WEIGHT),
                then: a.then.rate(then, REQUEST_PRIOR_WEIGHT),
                len,
            }
        };
        // Each decode slice's room to draft, and its best source's rates (an upper bound until
        // the draft says where it came from).
        let mut open: Vec<(usize, Offer)> = Vec::new();
        for (i, s) in plan.slices.iter().enumerate() {
            let Some(req) = requests.get(&s.id) else {
                continue;
            };
            if !s.samples || s.len != 1 || req.num_output_tokens() == 0 {
                continue;
            }
            // Every kept token and the model's own must fit `max_tokens` and the context.
            let left = (req.params.max_tokens as usize)
                .saturating_sub(req.num_output_tokens())
                .min(engine.max_model_len.saturating_sub(req.tokens.len()))
                .saturating_sub(1);
            let k = self.config.num_tokens.min(left);
            if k > 0 {
                let best = (0..SOURCES)
                    .map(|source| offer(req, source, k))
                    .max_by(|a, b| a.first.total_cmp(&b.first))
                    .unwrap_or(Offer {
                        first: 0.0,
                        then: 0.0,
                        len: 0,
                    });
                open.push((i, best));
            }
        }
        // Were every draft full length, how much of each would be verified? None: nothing is
        // proposed. A drafter that costs proposes no more than that.
        let draft_cost = self.drafter.cost_per_token();
        let bound: Vec<Offer> = open.iter().map(|&(_, o)| o).collect();
        let bound = choose(
            &bound,
            base_tokens,
            base_samples,
            room,
            &self.costs,
            draft_cost,
        );
        if bound.iter().all(|&n| n == 0) {
            return;
        }
        let mut asked = Vec::new();
        let mut asks = Vec::new();
        for (&(i, offer), &n) in open.iter().zip(&bound) {
            let k = if draft_cost > 0.0 { n } else { offer.len };
            let Some(req) = requests.get(&plan.slices[i].id).filter(|_| k > 0) else {
                continue;
            };
            asked.push(i);
            asks.push(DraftAsk {
                id: req.id,
                context: &req.tokens,
                num_prompt_tokens: req.num_prompt_tokens,
                k,
            });
        }
        let drafts = self.drafter.propose_batch(&asks);
        drop(asks);
        let mut candidates = Vec::new();
        let mut offers = Vec::new();
        for (&i, draft) in asked.iter().zip(drafts) {
            let Some(req) = requests.get(&plan.slices[i].id) else {
                continue;
            };
            if !draft.tokens.is_empty() && draft.source < SOURCES {
                offers.push(offer(req, draft.source, draft.tokens.len()));
                candidates.push(Candidate {
                    slice: i,
                    tokens: draft.tokens,
                    source: draft.source,
                });
            }
        }
        // The drafts exist now: their cost is spent, only verification's counts.
        let counts = choose(&offers, base_tokens, base_samples, room, &self.costs, 0.0);
        for (c, n) in candidates.iter().zip(counts) {
            let slice = &mut plan.slices[c.slice];
            let Some(req) = requests.get_mut(&slice.id) else {
                continue;
            };
            if n == 0 || !kv.allocate(req, slice.len + n) {
                continue;
            }
            req.tokens.extend_from_slice(&c.tokens[..n]);
            req.draft_source = c.source;
            slice.len += n;
            slice.draft = n;
        }
    }

    /// Takes the drafts back out of the requests' tokens (after the step, failed or not).
    pub(super) fn undraft(plan: &StepPlan, requests: &mut RequestMap<Request>) {
        for s in plan.slices.iter().filter(|s| s.draft > 0) {
            if let Some(req) = requests.get_mut(&s.id) {
                req.tokens.truncate(s.start + s.len - s.draft);
            }
        }
    }

    /// The step failed: the blocks taken for drafts go back.
    pub(super) fn abandon(plan: &StepPlan, requests: &mut RequestMap<Request>, kv: &KvManager) {
        for s in plan.slices.iter().filter(|s| s.draft > 0) {
            if let Some(req) = requests.get_mut(&s.id) {
                kv.truncate(req, req.num_computed_tokens);
            }
        }
    }

    /// A verified draft: the backend emitted `emitted` tokens for the slice, the draft's kept
    /// ones and the model's own. Returns the tokens of the draft kept.
    pub(super) fn settle(&mut self, slice: &Slice, emitted: usize, req: &mut Request) -> usize {
        let kept = emitted.saturating_sub(1).min(slice.draft);
        let source = req.draft_source.min(SOURCES - 1);
        req.acceptance[source].record(slice.draft, kept);
        self.acceptance[source].record(slice.draft, kept);
        let stats = &mut self.stats;
        stats.drafts += 1;
        stats.draft_tokens += slice.draft as u64;
        stats.accepted_tokens += kept as u64;
        for position in &mut stats.accepted_per_pos[..kept] {
            *position += 1;
        }
        kept
    }
}
