//! Session stickiness: which replica served a session last, for as long as the session stays
//! active (a TTL refreshed by each request), so that a conversation keeps its replica and the
//! KV cache there.

use crate::fleet::ReplicaId;
use std::collections::HashMap;

#[derive(Debug, Clone, Default)]
pub struct SessionTable {
    /// Session key → its binding.
    bound: HashMap<u64, Binding>,
}

/// Where a session was sent last, and when.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Binding {
    pub replica: ReplicaId,
    pub last_ms: u64,
    /// The tokens of its first prompt that a replica already held then (a system prompt
    /// other sessions share).
    pub shared: u64,
}

impl SessionTable {
    /// The replica `session` is bound to, unless the binding is older than `ttl_ms`.
    pub fn get(&self, session: u64, now_ms: u64, ttl_ms: u64) -> Option<ReplicaId> {
        self.bound
            .get(&session)
            .filter(|b| now_ms.saturating_sub(b.last_ms) < ttl_ms)
            .map(|b| b.replica)
    }

    /// The session's last binding, expired or not.
    pub fn binding(&self, session: u64) -> Option<Binding> {
        self.bound.get(&session).copied()
    }

    /// Binds `session` as `binding` says. Past `capacity` sessions, expired ones go first,
    /// then those idle for more than half the TTL, then the least recently used down to three
    /// quarters of the capacity (so that the sweep stays rare).
    pub fn bind(&mut self, session: u64, binding: Binding, ttl_ms: u64, capacity: usize) {
        let now_ms = binding.last_ms;
        self.bound.insert(session, binding);
        if self.bound.len() > capacity {
            self.bound
                .retain(|_, b| now_ms.saturating_sub(b.last_ms) < ttl_ms);
        }
        if self.bound.len() > capacity {
            self.bound
                .retain(|_, b| now_ms.saturating_sub(b.last_ms) < ttl_ms / 2);
        }
        if self.bound.len() > capacity {
            let mut times: Vec<u64> = self.bound.values().map(|b| b.last_ms).collect();
            times.sort_unstable_by(|a, b| b.cmp(a));
            let cutoff = times[(capacity * 3 / 4).min(times.len() - 1)];
            self.bound
                .retain(|k, b| b.last_ms > cutoff || *k == session);
        }
    }

    /// Drops every session bound to `replica` (it left the fleet or restarted).
    pub fn forget_replica(&mut self, replica: ReplicaId) {
        self.bound.retain(|_, b| b.replica != replica);
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

    fn at(replica: u32, last_ms: u64) -> Binding {
        Binding {
            replica: ReplicaId(replica),
            last_ms,
            shared: 0,
        }
    }

    #[test]
    fn bindings_expire_refresh_and_stay_bounded() {
        let mut t = SessionTable::default();
        t.bind(1, at(3, 0), 1000, 10);
        assert_eq!(t.get(1, 999, 1000), Some(ReplicaId(3)));
        assert_eq!(t.get(1, 1000, 1000), None);
        t.bind(1, at(4, 900), 1000, 10);
        assert_eq!(t.binding(1), Some(at(4, 900)));
        assert_eq!(t.get(1, 1500, 1000), Some(ReplicaId(4)));
        for k in 100..120 {
            t.bind(k, at(0, 2000 + k), 1000, 10);
        }
        assert!(t.len() <= 10, "{}", t.len());
        t.forget_replica(ReplicaId(0));
        assert!(t.is_empty());
    }
}
