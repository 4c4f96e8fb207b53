//! Approximate prefix index (text mode): which replica was sent which prefix chunks, learned
//! from the gateway's own routing decisions. Each replica remembers at most `capacity` chunk
//! hashes (LRU), standing in for the KV cache it cannot see.

use crate::lru::LruSet;
use crate::ReplicaId;
use kvgate_protocol::HashKeyMap;

#[derive(Debug, Clone)]
pub struct ApproxPrefixIndex {
    capacity: usize,
    /// chunk hash -> replicas believed to hold it.
    holders: HashKeyMap<Vec<ReplicaId>>,
    /// Per replica slot: its remembered chunks.
    per_replica: Vec<LruSet>,
}

impl ApproxPrefixIndex {
    pub fn new(capacity: usize) -> Self {
        ApproxPrefixIndex {
            capacity,
            holders: HashKeyMap::default(),
            per_replica: Vec::new(),
        }
    }

    /// Number of (replica, chunk) entries held.
    pub fn len(&self) -> usize {
        self.per_replica.iter().map(LruSet::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Records that `replica` now holds every chunk of `chunks`.
    pub fn insert(&mut self, replica: ReplicaId, chunks: &[u64]) {
        let slot = replica.0 as usize;
        if self.per_replica.len() <= slot {
            self.per_replica
                .resize_with(slot + 1, || LruSet::new(self.capacity));
        }
        for &chunk in chunks {
            let newly_held = !self.per_replica[slot].contains(chunk);
            if let Some(evicted) = self.per_replica[slot].insert(chunk) {
                self.remove_holder(evicted, replica);
            }
            if newly_held {
                self.holders.entry(chunk).or_default().push(replica);
            }
        }
    }

    /// Forgets everything `replica` held (it restarted or left the fleet).
    pub fn clear_replica(&mut self, replica: ReplicaId) {
        let Some(lru) = self.per_replica.get_mut(replica.0 as usize) else {
            return;
        };
        let old = std::mem::replace(lru, LruSet::new(self.capacity));
        for chunk in old.keys() {
            self.remove_holder(chunk, replica);
        }
    }

    /// For each replica holding a leading run of `chunks`, the length of that run.
    pub fn overlaps(&self, chunks: &[u64]) -> Vec<(ReplicaId, usize)> {
        let mut matched: Vec<(ReplicaId, usize)> = Vec::new();
        for (i, chunk) in chunks.iter().enumerate() {
            let Some(holders) = self.holders.get(chunk) else {
                break;
            };
            if i == 0 {
                matched.extend(holders.iter().map(|&r| (r, 1)));
            } else {
                let mut extended = false;
                for m in matched.iter_mut().filter(|m| m.1 == i) {
                    if holders.contains(&m.0) {
                        m.1 = i + 1;
                        extended = true;
                    }
                }
                if !extended {
                    break;
                }
            }
        }
        matched
    }

    fn remove_holder(&mut self, chunk: u64, replica: ReplicaId) {
        if let Some(list) = self.holders.get_mut(&chunk) {
            list.retain(|&r| r != replica);
            if list.is_empty() {
                self.holders.remove(&chunk);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: ReplicaId = ReplicaId(0);
    const B: ReplicaId = ReplicaId(1);

    #[test]
    fn overlap_counts_the_leading_run_only() {
        let mut idx = ApproxPrefixIndex::new(100);
        idx.insert(A, &[1, 2, 3]);
        idx.insert(B, &[1, 9]);
        let mut o = idx.overlaps(&[1, 2, 3, 4]);
        o.sort();
        assert_eq!(o, vec![(A, 3), (B, 1)]);
        assert!(
            idx.overlaps(&[7, 2, 3]).is_empty(),
            "a miss on the first chunk ends the run"
        );
    }

    #[test]
    fn capacity_evicts_and_clear_forgets() {
        let mut idx = ApproxPrefixIndex::new(2);
        idx.insert(A, &[1, 2, 3]);
        assert_eq!(idx.len(), 2);
        assert!(idx.overlaps(&[1]).is_empty(), "chunk 1 was evicted");
        idx.insert(B, &[2, 3]);
        idx.clear_replica(A);
        assert_eq!(idx.overlaps(&[2, 3]), vec![(B, 2)]);
        assert_eq!(idx.len(), 2);
    }
}
