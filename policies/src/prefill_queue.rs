//! The prompts one gateway has queued on a replica that await their first token (its prefill
//! backlog), and how far the replica has likely got through them. A backlog counts a prompt
//! whole until its first token, yet the replica has been computing it since it reached the
//! front: two replicas with one prompt queued each are not alike if one started on
//! it a step ago and the other is about to finish it. The pace at which a replica turns prompt
//! tokens into first tokens is learnt from the first tokens themselves, so it needs no report
//! and holds whatever the engine, its batch or the network in between.

use crate::fleet_state::RequestId;
use std::collections::VecDeque;

/// Each sample's weight against the ones before: about the last 16 first tokens count.
const DECAY: f64 = 15.0 / 16.0;

#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct PrefillQueue {
    /// Requests awaiting their first token, in the order sent: id, prompt tokens to compute,
    /// when sent.
    pending: VecDeque<(RequestId, u64, u64)>,
    /// Their prompt tokens in all.
    backlog: u64,
    last_first_token_ms: u64,
    /// Decayed sums of the prompt tokens computed and the milliseconds the replica spent on
    /// them (from when each reached the front to its first token).
    tokens: f64,
    busy_ms: f64,
}

impl PrefillQueue {
    /// The prompt tokens queued: those of the requests awaiting their first token.
    pub fn backlog(&self) -> u64 {
        self.backlog
    }

    pub fn sent(&mut self, request: RequestId, tokens: u64, now_ms: u64) {
        self.pending.push_back((request, tokens, now_ms));
        self.backlog += tokens;
    }

    /// The request's first token came at `now_ms`: it leaves the queue and teaches the pace.
    pub fn first_token(&mut self, request: RequestId, now_ms: u64) {
        let Some((tokens, sent_ms)) = self.remove(request) else {
            return;
        };
        let started = sent_ms.max(self.last_first_token_ms);
        self.tokens = self.tokens * DECAY + tokens as f64;
        self.busy_ms = self.busy_ms * DECAY + now_ms.saturating_sub(started) as f64;
        self.last_first_token_ms = self.last_first_token_ms.max(now_ms);
    }

    /// The request ended without a first token (failed, or moved to another replica).
    pub fn finished(&mut self, request: RequestId) {
        self.remove(request);
    }

    /// Prompt tokens of the one request awaiting its first token likely computed by `now_ms`:
    /// the time since it reached the front at the learnt pace, at most its own tokens (a
    /// replica that stalls keeps its backlog). None before the first sample, and none while
    /// more than one waits: the engine then prefills several in each step, in chunks, and how
    /// far each has got is not the front's time at the pace.
    pub fn progress(&self, now_ms: u64) -> u64 {
        let (Some(&(_, tokens, sent_ms)), 1) = (self.pending.front(), self.pending.len()) else {
            return 0;
        };
        let Some(pace) = self.pace() else {
            return 0;
        };
        let since = sent_ms.max(self.last_first_token_ms);
        (now_ms.saturating_sub(since) as f64 * pace).min(tokens as f64) as u64
    }

    /// Prompt tokens a millisecond it has turned into first tokens (None before the first).
    pub fn pace(&self) -> Option<f64> {
        // Within the clock's millisecond a first token shows no time spent: at most the sum's
        // tokens a millisecond.
        (self.tokens > 0.0).then(|| self.tokens / self.busy_ms.max(1.0))
    }

    fn remove(&mut self, request: RequestId) -> Option<(u64, u64)> {
        let at = self.pending.iter().position(|(id, ..)| *id == request)?;
        let (_, tokens, sent) = self.pending.remove(at)?;
        self.backlog -= tokens;
        Some((tokens, sent))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_is_discounted_before_a_first_token_is_seen() {
        let mut p = PrefillQueue::default();
        p.sent(1, 1_000, 0);
        assert_eq!(p.progress(500), 0);
    }

    #[test]
    fn the_one_request_waiting_progresses_at_the_learnt_pace_up_to_its_length() {
        let mut p = PrefillQueue::default();
        // 1,000 tokens in 10 ms: 100 a millisecond.
        p.sent(1, 1_000, 0);
        p.first_token(1, 10);
        p.sent(2, 500, 20);
        assert_eq!(p.progress(20), 0);
        assert_eq!(p.progress(23), 300);
        // Never more than its own tokens: a replica that stalls keeps its backlog.
        assert_eq!(p.progress(100), 500);
        // Two waiting: no estimate.
        p.sent(3, 800, 21);
        assert_eq!(p.progress(23), 0);
        p.first_token(2, 25);
        // The next one reached the front with the first token before it.
        assert_eq!(p.progress(27), 200);
    }

    #[test]
    fn requests_sent_together_count_the_time_once() {
        let mut p = PrefillQueue::default();
        p.sent(1, 600, 0);
        p.sent(2, 600, 0);
        p.first_token(1, 6);
        // Prefilled in the same step: no time of its own.
        p.first_token(2, 6);
        p.sent(3, 2_400, 10);
        // 600 and 600 tokens in 6 ms (the first sample decayed by 15/16): 1,162.5 / 5.625.
        assert_eq!(p.progress(11), 206);
    }

    #[test]
    fn a_request_that_ends_without_a_first_token_leaves_the_queue_and_teaches_nothing() {
        let mut p = PrefillQueue::default();
        p.sent(1, 1_000, 0);
        p.first_token(1, 10);
        p.sent(2, 400, 10);
        p.sent(3, 700, 11);
        p.finished(2);
        assert_eq!(p.progress(12), 100);
        p.first_token(2, 50);
        assert_eq!(p.progress(14), 300);
        assert!(p.pending.iter().all(|(id, ..)| *id == 3));
    }
}
