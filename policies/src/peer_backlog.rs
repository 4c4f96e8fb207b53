//! The prefill other gateways have queued on each replica, as each last said through the
//! decision exchange. A gateway counts the prompt tokens it sent until their first token; with
//! N gateways in front of one fleet each sees about 1/N of the work ahead on a replica, and
//! all of them pile onto the replica that looks idle to each. A peer's word replaces its last
//! and lapses at a deadline, so a lost push is repaired by the next and a dead peer's backlog
//! stops counting.

use crate::ReplicaId;

/// A peer's word lapses this long after it arrives; a peer repeats a backlog it still has
/// every quarter of it.
pub const LAPSE_MS: u64 = 1_000;

/// Peers remembered at most; past it the one whose word lapses first is forgotten.
pub const MAX_PEERS: usize = 64;

#[derive(Debug, Clone, Default)]
pub(crate) struct PeerBacklogs {
    peers: Vec<PeerBacklog>,
}

#[derive(Debug, Clone)]
struct PeerBacklog {
    peer: u64,
    expires_ms: u64,
    tokens: Vec<(ReplicaId, u64)>,
}

impl PeerBacklogs {
    /// Peer `peer` has `tokens` queued per replica (those it does not name: none), until
    /// `expires_ms` unless it says otherwise before.
    pub fn set(&mut self, peer: u64, tokens: Vec<(ReplicaId, u64)>, expires_ms: u64) {
        let entry = PeerBacklog {
            peer,
            expires_ms,
            tokens,
        };
        if let Some(known) = self.peers.iter_mut().find(|p| p.peer == peer) {
            *known = entry;
            return;
        }
        if self.peers.len() >= MAX_PEERS {
            let first = (0..self.peers.len()).min_by_key(|&i| self.peers[i].expires_ms);
            if let Some(i) = first {
                self.peers.swap_remove(i);
            }
        }
        self.peers.push(entry);
    }

    /// Every live peer's backlog summed, by replica slot (`slots` long).
    pub fn totals(&self, now_ms: u64, slots: usize) -> Vec<u64> {
        let mut totals = vec![0u64; slots];
        for p in self.peers.iter().filter(|p| p.expires_ms > now_ms) {
            for &(id, tokens) in &p.tokens {
                if let Some(t) = totals.get_mut(id.0 as usize) {
                    *t = t.saturating_add(tokens);
                }
            }
        }
        totals
    }

    /// Slots changed meaning: what peers said about them no longer applies.
    pub fn clear(&mut self) {
        self.peers.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_word_replaces_its_last_and_lapses() {
        let mut b = PeerBacklogs::default();
        b.set(1, vec![(ReplicaId(0), 100), (ReplicaId(2), 5)], 1_000);
        b.set(2, vec![(ReplicaId(0), 50)], 2_000);
        assert_eq!(b.totals(0, 3), [150, 0, 5]);
        b.set(1, vec![(ReplicaId(1), 7)], 1_000);
        assert_eq!(b.totals(0, 3), [50, 7, 0]);
        // Peer 1's word lapses; a slot past the fleet is ignored.
        b.set(2, vec![(ReplicaId(0), 50), (ReplicaId(9), 1)], 2_000);
        assert_eq!(b.totals(1_000, 3), [50, 0, 0]);
        b.clear();
        assert_eq!(b.totals(0, 3), [0, 0, 0]);
    }

    #[test]
    fn past_the_bound_the_soonest_to_lapse_is_forgotten() {
        let mut b = PeerBacklogs::default();
        for peer in 0..MAX_PEERS as u64 {
            b.set(peer, vec![(ReplicaId(0), 1)], 100 + peer);
        }
        b.set(999, vec![(ReplicaId(0), 1_000)], 50);
        assert_eq!(b.peers.len(), MAX_PEERS);
        assert!(b.peers.iter().all(|p| p.peer != 0));
        assert_eq!(b.totals(0, 1), [MAX_PEERS as u64 - 1 + 1_000]);
    }
}
