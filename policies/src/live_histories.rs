//! The session histories live on each replica: each session's own tokens (past a prefix other
//! sessions share) as of its last turn, for as long as its next turn is due. A session counts
//! until twice the gap between its last two turns has passed (the first turn, until
//! `first_ms`), at most `ttl_ms`: one that stopped sending drops out soon after, however long
//! its binding is kept. Past `capacity` sessions, those due soonest drop out first.

use crate::ReplicaId;
use kvgate_protocol::HashKeyMap;
use std::collections::BTreeSet;

/// The least a live session counts for after its turn, whatever its gap.
const MIN_LIVE_MS: u64 = 1_000;

#[derive(Debug, Clone, Copy)]
struct Live {
    replica: ReplicaId,
    tokens: u64,
    last_ms: u64,
    until_ms: u64,
}

#[derive(Debug, Clone, Default)]
pub(crate) struct LiveHistories {
    by_session: HashKeyMap<Live>,
    /// (until, session) of every entry counted, soonest first.
    due: BTreeSet<(u64, u64)>,
    /// By replica slot: the tokens of the sessions live there.
    tokens: Vec<u64>,
}

impl LiveHistories {
    /// Session `session`'s turn of `tokens` own tokens went to `replica` at `now_ms`.
    pub fn turn(
        &mut self,
        session: u64,
        replica: ReplicaId,
        tokens: u64,
        now_ms: u64,
        (first_ms, ttl_ms, capacity): (u64, u64, usize),
    ) {
        self.expire(now_ms);
        let gap = self.by_session.remove(&session).map(|old| {
            self.due.remove(&(old.until_ms, session));
            self.take(old);
            now_ms.saturating_sub(old.last_ms)
        });
        let live_ms = gap.map_or(first_ms, |g| g.saturating_mul(2).max(MIN_LIVE_MS));
        let until_ms = now_ms.saturating_add(live_ms.min(ttl_ms));
        let live = Live {
            replica,
            tokens,
            last_ms: now_ms,
            until_ms,
        };
        let slot = replica.0 as usize;
        if self.tokens.len() <= slot {
            self.tokens.resize(slot + 1, 0);
        }
        self.tokens[slot] = self.tokens[slot].saturating_add(tokens);
        self.by_session.insert(session, live);
        self.due.insert((until_ms, session));
        while self.by_session.len() > capacity.max(1) {
            self.lapse_first();
        }
    }

    /// The tokens of the sessions live on `replica` at `now_ms`.
    pub fn on(&self, replica: ReplicaId, now_ms: u64) -> u64 {
        let counted = self.tokens.get(replica.0 as usize).copied().unwrap_or(0);
        // Those lapsed since the last turn recorded: usually none.
        let lapsed: u64 = self
            .due
            .range(..=(now_ms, u64::MAX))
            .filter_map(|(_, s)| self.by_session.get(s))
            .filter(|l| l.replica == replica)
            .map(|l| l.tokens)
            .sum();
        counted.saturating_sub(lapsed)
    }

    /// `session`'s own tokens live on `replica` at `now_ms`.
    pub fn of_session(&self, session: u64, replica: ReplicaId, now_ms: u64) -> u64 {
        self.by_session
            .get(&session)
            .filter(|l| l.replica == replica && l.until_ms > now_ms)
            .map_or(0, |l| l.tokens)
    }

    /// Forgets every session live on `replica` (it left the fleet or restarted).
    pub fn clear_replica(&mut self, replica: ReplicaId) {
        let due = &mut self.due;
        self.by_session.retain(|&s, l| {
            let keep = l.replica != replica;
            if !keep {
                due.remove(&(l.until_ms, s));
            }
            keep
        });
        if let Some(t) = self.tokens.get_mut(replica.0 as usize) {
            *t = 0;
        }
    }

    fn expire(&mut self, now_ms: u64) {
        while self.due.first().is_some_and(|&(until, _)| until <= now_ms) {
            self.lapse_first();
        }
    }

    fn lapse_first(&mut self) {
        if let Some((_, session)) = self.due.pop_first() {
            if let Some(live) = self.by_session.remove(&session) {
                self.take(live);
            }
        }
    }

    fn take(&mut self, live: Live) {
        if let Some(t) = self.tokens.get_mut(live.replica.0 as usize) {
            *t = t.saturating_sub(live.tokens);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const R0: ReplicaId = ReplicaId(0);
    const R1: ReplicaId = ReplicaId(1);
    const LIMITS: (u64, u64, usize) = (10_000, 600_000, 100);

    #[test]
    fn a_session_counts_once_where_its_last_turn_went_until_its_next_is_overdue() {
        let mut live = LiveHistories::default();
        live.turn(1, R0, 1_000, 0, LIMITS);
        live.turn(2, R0, 500, 0, LIMITS);
        assert_eq!(live.on(R0, 0), 1_500);
        // Its next turn replaces it, here on another replica, 3 s later.
        live.turn(1, R1, 1_200, 3_000, LIMITS);
        assert_eq!((live.on(R0, 3_000), live.on(R1, 3_000)), (500, 1_200));
        assert_eq!(live.of_session(1, R1, 3_000), 1_200);
        assert_eq!(live.of_session(1, R0, 3_000), 0);
        // Session 1's next turn was due by 9 s, session 2's second by 10 s: read before any
        // other turn is recorded, and after.
        assert_eq!((live.on(R0, 9_000), live.on(R1, 9_000)), (500, 0));
        assert_eq!(live.of_session(1, R1, 9_000), 0);
        live.turn(3, R0, 7, 9_000, LIMITS);
        assert_eq!((live.on(R0, 9_000), live.on(R1, 9_000)), (507, 0));
        assert_eq!(live.on(R0, 10_000), 7, "session 2 lapsed");
        live.turn(3, R0, 7, 10_000, LIMITS);
        assert_eq!(live.on(R0, 10_000), 7);
        live.clear_replica(R0);
        assert_eq!(live.on(R0, 10_000), 0);
        // What was cleared does not lapse again later, from a session bound afresh.
        live.turn(3, R1, 9, 10_500, LIMITS);
        assert_eq!(live.on(R1, 11_400), 9);
    }

    #[test]
    fn past_its_capacity_the_session_due_soonest_drops_out() {
        let mut live = LiveHistories::default();
        for s in 0..5 {
            live.turn(s, R0, 10, s, (10_000, 600_000, 3));
        }
        assert_eq!(live.on(R0, 5), 30);
        assert_eq!(live.of_session(0, R0, 5), 0);
        assert_eq!(live.of_session(4, R0, 5), 10);
    }
}
