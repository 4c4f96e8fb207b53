//! Prefill work: how many prompt tokens a replica must compute before a request's first token.
//! Requests differ in length by orders of magnitude (long documents beside short chats), so
//! counting requests alone cannot tell a replica busy prefilling 30,000 tokens from one with
//! a few short decodes.

use crate::ReplicaView;

/// A prompt's length in tokens and in the unit the prefix index counts (blocks or chunks),
/// and how its recompute is counted.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PromptWork {
    tokens: u64,
    blocks: f64,
    /// The most of it any candidate holds, and what each token of that a replica would
    /// recompute counts besides itself.
    most_held: f64,
    recompute_penalty: f64,
    /// The recompute at which the penalty is whole (0: always whole).
    penalty_full_at: u64,
    /// The rest of the step under way counts (see [`PromptWork::without_step_wait`]).
    step_wait: bool,
    /// The wait for KV room counts (see [`PromptWork::without_kv_wait`]).
    kv_wait: bool,
    /// How many times over the penalty counts for the fleet's queues (at least once; see
    /// [`PromptWork::with_fleet_queues`]).
    busy_fleet: f64,
}

impl PromptWork {
    pub fn new(tokens: u64, blocks: usize) -> Self {
        PromptWork {
            tokens,
            blocks: blocks as f64,
            most_held: 0.0,
            recompute_penalty: 0.0,
            penalty_full_at: 0,
            step_wait: true,
            kv_wait: true,
            busy_fleet: 1.0,
        }
    }

    /// The step under way is not counted: it decides where one request's first token comes
    /// soonest, not where a session's turns should live (its first turn places them all, and
    /// a later one moved off its home for a step's wait recomputes its history, compute the
    /// fleet needs).
    pub fn without_step_wait(self) -> Self {
        PromptWork {
            step_wait: false,
            ..self
        }
    }

    /// The wait for KV room is not counted: every replica's engine queues, so the fleet is
    /// short of KV, not one replica, and a prompt moved for its wait only copies its prefix
    /// into another full cache.
    pub fn without_kv_wait(self) -> Self {
        PromptWork {
            kv_wait: false,
            ..self
        }
    }

    /// The rest of `r`'s step under way as counted here.
    pub fn step_wait_on(&self, r: &ReplicaView) -> u64 {
        if self.step_wait {
            r.step_wait
        } else {
            0
        }
    }

    /// Counts the tokens a replica would recompute, of the `most_held` blocks some candidate
    /// holds, `penalty` times more; a recompute shorter than `full_at` tokens (when not 0) that
    /// share of `penalty` times more, or the share of the replica's KV in use if more.
    pub fn with_recompute_penalty(self, most_held: f64, penalty: f64, full_at: u64) -> Self {
        PromptWork {
            most_held,
            recompute_penalty: penalty.max(0.0),
            penalty_full_at: full_at,
            ..self
        }
    }

    /// Counts the recompute penalty more where the fleet is busy: the healthy `replicas`' mean
    /// work ahead of a new prompt, in prompts of this one's length, times over (at least
    /// once). A copy moves a request off one queue onto another; where the replicas have more
    /// than a prompt ahead on average, the fleet is short of capacity rather than one replica
    /// of it, and the copy's recompute adds work to a fleet that cannot spare it (and the
    /// longer the queues, the more requests wait behind it before they drain). Set after
    /// [`PromptWork::without_kv_wait`]: the work ahead is as this prompt counts it.
    pub fn with_fleet_queues<'a>(self, replicas: impl Iterator<Item = &'a ReplicaView>) -> Self {
        let (ahead, healthy) = replicas
            .filter(|r| r.healthy)
            .fold((0u64, 0u64), |(ahead, n), r| {
                (ahead.saturating_add(self.queued_on(r)), n + 1)
            });
        let prompts = ahead as f64 / healthy.max(1) as f64 / self.tokens.max(1) as f64;
        PromptWork {
            busy_fleet: prompts.max(1.0),
            ..self
        }
    }

    /// The work ahead of a whole new prompt on `r`: its backlog less what it has likely
    /// computed, or its wait for KV room where that is longer.
    fn queued_on(&self, r: &ReplicaView) -> u64 {
        r.prefill_ahead().max(self.kv_wait_on(r, self.tokens))
    }

    /// Tokens left to prefill on a replica holding `held` of the prompt's leading blocks: the
    /// share of blocks it does not hold, applied to the prompt's tokens (off by at most the
    /// partial last block, which no replica holds).
    pub fn uncached(&self, held: f64) -> u64 {
        if self.blocks <= 0.0 {
            return self.tokens;
        }
        let share = (held / self.blocks).clamp(0.0, 1.0);
        (self.tokens as f64 * (1.0 - share)).round() as u64
    }

    /// The prefill ahead of this request's first token on `r`: its backlog less what it has
    /// likely computed of it and the rest of the step under way, or its wait for KV room where
    /// that is longer; and the part of the prompt it does not hold, that part's recompute of
    /// what another holds penalised.
    pub fn ahead_on(&self, r: &ReplicaView, held: f64) -> u64 {
        let uncached = self.uncached(held);
        let recompute = uncached.saturating_sub(self.uncached(self.most_held));
        let weight = if self.costs_nothing_on(r, uncached) {
            0.0
        } else {
            self.penalty_weight(r, recompute)
        };
        let penalty =
            (recompute as f64 * self.recompute_penalty * weight * self.busy_fleet).round() as u64;
        // Queued prompts are computed while the queue waits for room: whichever is longer.
        let queued = r.prefill_ahead().saturating_add(self.step_wait_on(r));
        queued
            .max(self.kv_wait_on(r, uncached))
            .saturating_add(uncached)
            .saturating_add(penalty)
    }

    /// The wait for KV room on `r` before a prompt of `uncached` tokens to compute starts
    /// there. Where its engine queues requests, it admits them, then this one, as its room
    /// takes them (each counted as long as this one), the rest one running request's end
    /// apart. With none queued, nothing is counted: an engine that prefills in chunks starts
    /// a prompt in whatever room it has.
    pub fn kv_wait_on(&self, r: &ReplicaView, uncached: u64) -> u64 {
        let Some(room) = r
            .kv_room_tokens()
            .filter(|_| self.kv_wait && r.kv_queue > 0)
        else {
            return 0;
        };
        let admitted_at_once = room / uncached.max(1);
        (u64::from(r.kv_queue) + 1)
            .saturating_sub(admitted_at_once)
            .saturating_mul(r.admit_interval)
    }

    /// Whether a copy of the prompt's `uncached` tokens on `r` costs others nothing: nothing
    /// is queued there, so it delays no one, and its blocks fit where the cache holds nothing,
    /// so it evicts nothing. Only with `penalty_full_at`, which is set only for a group whose
    /// copies will be used again.
    fn costs_nothing_on(&self, r: &ReplicaView, uncached: u64) -> bool {
        self.penalty_full_at > 0
            && r.prefill_backlog == 0
            && r.waiting == 0
            && r.kv_empty_tokens.is_some_and(|room| room >= uncached)
    }

    /// The share of the penalty a recompute of `recompute` tokens on `r` counts: its length's
    /// share of `penalty_full_at`, or the share of `r`'s KV blocks its running requests use
    /// where that is more (a copy there takes blocks another prefix may soon want back); all
    /// of it without `penalty_full_at`, or when `r` reports no KV use.
    fn penalty_weight(&self, r: &ReplicaView, recompute: u64) -> f64 {
        match self.penalty_full_at {
            0 => 1.0,
            full_at => (recompute as f64 / full_at as f64)
                .min(1.0)
                .max(r.kv_usage.map_or(1.0, |u| u.clamp(0.0, 1.0))),
        }
    }

    /// The signal: `(least + prompt) / (work + prompt)`, 1 for the replica with the least work,
    /// at most 0.5 for one with a whole prompt's length more.
    pub fn relative(&self, least: u64, work: u64) -> f64 {
        let prompt = self.tokens.max(1) as f64;
        (least as f64 + prompt) / (work as f64 + prompt)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An idle healthy replica that reports nothing.
    fn idle_replica() -> ReplicaView {
        ReplicaView {
            healthy: true,
            ..ReplicaView::default()
        }
    }

    #[test]
    fn uncached_is_the_share_of_blocks_not_held() {
        let w = PromptWork::new(1_000, 10);
        assert_eq!(w.uncached(0.0), 1_000);
        assert_eq!(w.uncached(4.0), 600);
        assert_eq!(w.uncached(10.0), 0);
        // Shorter than one block: nothing can be held.
        assert_eq!(PromptWork::new(7, 0).uncached(0.0), 7);
    }

    #[test]
    fn a_short_recompute_on_a_replica_with_kv_to_spare_is_penalised_in_proportion() {
        let idle = |kv_usage: Option<f64>| ReplicaView {
            kv_usage,
            ..idle_replica()
        };
        let roomy = idle(Some(0.1));
        // 1,000 tokens, 10 blocks; another candidate holds 8 of them (800 tokens).
        let whole = PromptWork::new(1_000, 10).with_recompute_penalty(8.0, 2.0, 0);
        assert_eq!(whole.ahead_on(&roomy, 0.0), 1_000 + 2 * 800);
        let ramp = PromptWork::new(1_000, 10).with_recompute_penalty(8.0, 2.0, 1_600);
        assert_eq!(ramp.ahead_on(&roomy, 0.0), 1_000 + 800);
        // Holding 4 blocks, it would recompute 400 tokens: a quarter of full_at.
        assert_eq!(ramp.ahead_on(&roomy, 4.0), 600 + 200);
        // At full_at and past it the penalty is whole.
        let short_ramp = PromptWork::new(1_000, 10).with_recompute_penalty(8.0, 2.0, 800);
        assert_eq!(short_ramp.ahead_on(&roomy, 0.0), 1_000 + 2 * 800);
        // The holder recomputes nothing, whatever the ramp.
        assert_eq!(ramp.ahead_on(&roomy, 8.0), 200);
        // Three quarters of its KV in use by running requests: more than the length's half.
        assert_eq!(ramp.ahead_on(&idle(Some(0.75)), 0.0), 1_000 + 1_200);
        // An engine that reports no KV use: the whole penalty.
        assert_eq!(ramp.ahead_on(&idle(None), 0.0), 1_000 + 2 * 800);
    }

    #[test]
    fn the_penalty_counts_as_many_times_over_as_the_fleet_has_prompts_ahead_on_average() {
        let queued = |prefill_backlog: u64, healthy: bool| ReplicaView {
            prefill_backlog,
            healthy,
            ..idle_replica()
        };
        // 1,000 tokens, 10 blocks; another candidate holds 8 of them: 1,600 tokens of penalty.
        let w = PromptWork::new(1_000, 10).with_recompute_penalty(8.0, 2.0, 0);
        let on_idle = |fleet: &[ReplicaView]| {
            w.with_fleet_queues(fleet.iter())
                .ahead_on(&idle_replica(), 0.0)
        };
        // Under a prompt ahead on average: the penalty once.
        assert_eq!(
            on_idle(&[queued(1_500, true), queued(0, true)]),
            1_000 + 1_600
        );
        // Three prompts ahead on average: three times; an unhealthy replica is not counted.
        assert_eq!(
            on_idle(&[queued(6_000, true), queued(0, true), queued(0, false)]),
            1_000 + 3 * 1_600
        );
        // The holder recomputes nothing, however busy the fleet.
        let busy = [queued(6_000, true), queued(0, true)];
        assert_eq!(
            w.with_fleet_queues(busy.iter()).ahead_on(&busy[1], 8.0),
            200
        );
    }

    #[test]
    fn a_copy_of_a_recurring_prompt_into_an_idle_replicas_empty_blocks_is_not_penalised() {
        let replica =
            |prefill_backlog: u64, waiting: u32, kv_empty_tokens: Option<u64>| ReplicaView {
                waiting,
                prefill_backlog,
                kv_usage: Some(0.5),
                kv_empty_tokens,
                ..idle_replica()
            };
        // 1,000 tokens, 10 blocks; another candidate holds 8 of them; the whole penalty.
        let recurring = PromptWork::new(1_000, 10).with_recompute_penalty(8.0, 2.0, 800);
        let roomy = replica(0, 0, Some(1_000));
        assert_eq!(recurring.ahead_on(&roomy, 0.0), 1_000);
        // Room for only part of the copy: it would evict, so the penalty stands.
        assert_eq!(
            recurring.ahead_on(&replica(0, 0, Some(999)), 0.0),
            1_000 + 2 * 800
        );
        // Prefill queued there, by this gateway or as its agent reports: the copy delays it.
        assert_eq!(
            recurring.ahead_on(&replica(1, 0, Some(5_000)), 0.0),
            1 + 1_000 + 2 * 800
        );
        assert_eq!(
            recurring.ahead_on(&replica(0, 1, Some(5_000)), 0.0),
            1_000 + 2 * 800
        );
        // Room unknown (no report or no KV events yet).
        assert_eq!(
            recurring.ahead_on(&replica(0, 0, None), 0.0),
            1_000 + 2 * 800
        );
        // A group seen once or twice (its copy would not be used again), or the whole
        // penalty asked for always (`recompute_penalty_full_at: 0`).
        let always = PromptWork::new(1_000, 10).with_recompute_penalty(8.0, 2.0, 0);
        assert_eq!(always.ahead_on(&roomy, 0.0), 1_000 + 2 * 800);
    }

    #[test]
    fn the_wait_for_kv_room_counts_in_place_of_the_queue_where_longer() {
        let queued = |prefill_backlog: u64, waiting: u32| ReplicaView {
            waiting,
            prefill_backlog,
            admit_interval: 100,
            kv_queue: waiting,
            kv_usage: Some(0.75),
            kv_capacity_tokens: Some(1_000),
            ..idle_replica()
        };
        let w = PromptWork::new(100, 1);
        // 250 tokens free take 2 of the 4 queued at once; the other 2 and this one wait 100.
        assert_eq!(w.kv_wait_on(&queued(0, 4), 100), 300);
        assert_eq!(w.ahead_on(&queued(0, 4), 0.0), 300 + 100);
        // The queue's prompts are computed during that wait; the longer of the two counts.
        assert_eq!(w.ahead_on(&queued(200, 4), 0.0), 300 + 100);
        assert_eq!(w.ahead_on(&queued(500, 4), 0.0), 500 + 100);
        // Nothing queued, or room for the queue and this one: no wait.
        assert_eq!(w.kv_wait_on(&queued(0, 0), 100), 0);
        assert_eq!(w.kv_wait_on(&queued(0, 1), 100), 0);
        // No KV use reported: unknown, none counted.
        let unreported = ReplicaView {
            kv_usage: None,
            ..queued(0, 4)
        };
        assert_eq!(w.kv_wait_on(&unreported, 100), 0);
        // Not counted at all (every replica queues).
        let uncounted = w.without_kv_wait();
        assert_eq!(uncounted.kv_wait_on(&queued(0, 4), 100), 0);
        assert_eq!(uncounted.ahead_on(&queued(0, 4), 0.0), 100);
    }

    #[test]
    fn relative_is_one_for_the_least_work_and_half_a_prompt_later() {
        let w = PromptWork::new(1_000, 10);
        assert_eq!(w.relative(300, 300), 1.0);
        assert_eq!(w.relative(300, 1_300), (300.0 + 1_000.0) / 2_300.0);
        assert!(w.relative(0, 1_000) == 0.5);
        // An empty prompt still compares backlogs.
        assert!(PromptWork::new(0, 0).relative(0, 10) < 0.1);
    }
}
