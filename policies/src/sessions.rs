//! Session stickiness: which replica served a session last, for as long as the session stays
//! active (a TTL refreshed by each request), so that a conversation keeps its replica and the
//! KV cache there.

use crate::fleet::ReplicaId;
use std::collections::HashMap;

#[derive(Debug, Clone, Default)]
pub struct SessionTable {
    /// Session key → (replica, last use in ms).
    bound: HashMap<u64, (ReplicaId, u64)>,
}

impl SessionTable {
    /// The replica `session` is bound to, unless the binding is older than `ttl_ms`.
    pub fn get(&self, session: u64, now_ms: u64, ttl_ms: u64) -> Option<ReplicaId> {
        self.bound
            .get(&session)
            .filter(|(_, last)| now_ms.saturating_sub(*last) < ttl_ms)
            .map(|(r, _)| *r)
    }

    /// Binds `session` to `replica` as of `now_ms`. Past `capacity` sessions, expired ones go
    /// first, then those idle for more than half the TTL, then the least recently used down to
    /// three quarters of the capacity (so that the sweep stays rare).
    pub fn bind(
        &mut self,
        session: u64,
        replica: ReplicaId,
        now_ms: u64,
        ttl_ms: u64,
        capacity: usize,
    ) {
        self.bound.insert(session, (replica, now_ms));
        if self.bound.len() > capacity {
            self.bound
                .retain(|_, (_, t)| now_ms.saturating_sub(*t) < ttl_ms);
        }
        if self.bound.len() > capacity {
            self.bound
                .retain(|_, (_, t)| now_ms.saturating_sub(*t) < ttl_ms / 2);
        }
        if self.bound.len() > capacity {
            let mut times: Vec<u64> = self.bound.values().map(|(_, t)| *t).collect();
            times.sort_unstable_by(|a, b| b.cmp(a));
            let cutoff = times[(capacity * 3 / 4).min(times.len() - 1)];
            self.bound.retain(|k, (_, t)| *t > cutoff || *k == session);
        }
    }

    /// Drops every session bound to `replica` (it left the fleet or restarted).
    pub fn forget_replica(&mut self, replica: ReplicaId) {
        self.bound.retain(|_, (r, _)| *r != replica);
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.bound.len()
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.bound.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bindings_expire_refresh_and_stay_bounded() {
        let mut t = SessionTable::default();
        t.bind(1, ReplicaId(3), 0, 1000, 10);
        assert_eq!(t.get(1, 999, 1000), Some(ReplicaId(3)));
        assert_eq!(t.get(1, 1000, 1000), None);
        t.bind(1, ReplicaId(4), 900, 1000, 10);
        assert_eq!(t.get(1, 1500, 1000), Some(ReplicaId(4)));
        for k in 100..120 {
            t.bind(k, ReplicaId(0), 2000 + k, 1000, 10);
        }
        assert!(t.len() <= 10, "{}", t.len());
        t.forget_replica(ReplicaId(0));
        assert!(t.is_empty());
    }
}
