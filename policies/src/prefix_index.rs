//! Approximate prefix index (text mode): which replica was sent which prefix chunks, learned
//! from the gateway's own routing decisions. Each replica remembers at most `capacity` chunk
//! hashes (LRU), standing in for the KV cache it cannot see.

use crate::in_order::InOrder;
use crate::lru::LruSet;
use crate::ReplicaId;
use kvgate_protocol::HashKeyMap;

#[derive(Debug, Clone)]
pub struct ApproxPrefixIndex {
    capacity: usize,
    /// chunk hash -> replicas believed to hold it, in replica order.
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

    /// Records that `replica` now holds every chunk of `chunks`. The head is touched last, so
    /// that eviction takes a prompt's tail first, as engines evict a prefix: a run shortened
    /// at its end keeps its worth, one cut at its head has none.
    pub fn insert(&mut self, replica: ReplicaId, chunks: &[u64]) {
        let slot = replica.0 as usize;
        if self.per_replica.len() <= slot {
            self.per_replica
                .resize_with(slot + 1, || LruSet::new(self.capacity));
        }
        for &chunk in chunks.iter().rev() {
            let newly_held = !self.per_replica[slot].contains(chunk);
            if let Some(evicted) = self.per_replica[slot].insert(chunk) {
                self.remove_holder(evicted, replica);
            }
            if newly_held {
                let holders = self.holders.entry(chunk).or_default();
                if let Err(at) = holders.binary_search(&replica) {
                    holders.insert(at, replica);
                }
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

    /// For each replica holding a leading run of `chunks`, the length of that run. One walk
    /// over the chunks with the replicas whose run goes on, each chunk's holders merged with
    /// them in replica order: a long prompt the whole fleet holds costs chunks x replicas.
    pub fn overlaps(&self, chunks: &[u64]) -> Vec<(ReplicaId, usize)> {
        let holders = |chunk| self.holders.get(chunk).map_or(&[][..], Vec::as_slice);
        let Some(first) = chunks.first() else {
            return Vec::new();
        };
        let mut going: Vec<ReplicaId> = holders(first).to_vec();
        let mut ended = Vec::new();
        for (i, chunk) in chunks.iter().enumerate().skip(1) {
            if going.is_empty() {
                break;
            }
            keep_holders(&mut going, holders(chunk), |r| ended.push((r, i)));
        }
        ended.extend(going.into_iter().map(|r| (r, chunks.len())));
        ended
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

/// Keeps in `going` the replicas `holders` lists (both in replica order); `ended` gets the
/// others.
fn keep_holders(
    going: &mut Vec<ReplicaId>,
    holders: &[ReplicaId],
    mut ended: impl FnMut(ReplicaId),
) {
    if same_replicas(going, holders) {
        return;
    }
    let mut holders = InOrder::new(holders, |&r| r);
    going.retain(|&r| {
        let held = holders.find(r).is_some();
        if !held {
            ended(r);
        }
        held
    });
}

/// `a == b` without a branch an entry: a slice of a newtype compares entry by entry, and a
/// long prompt the whole fleet holds compares a list of every replica at each chunk.
fn same_replicas(a: &[ReplicaId], b: &[ReplicaId]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0, |diff, (x, y)| diff | (x.0 ^ y.0)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

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
        assert_eq!(
            idx.overlaps(&[1, 2, 3]),
            vec![(A, 2)],
            "the tail was evicted"
        );
        idx.insert(A, &[4, 5]);
        assert!(idx.overlaps(&[1]).is_empty(), "the older prompt went first");
        idx.insert(B, &[2, 3]);
        idx.clear_replica(A);
        assert_eq!(idx.overlaps(&[2, 3]), vec![(B, 2)]);
        assert_eq!(idx.len(), 2);
    }

    proptest! {
        /// Each replica's run is the leading chunks it remembers, whoever else holds them.
        #[test]
        fn overlaps_are_each_replicas_leading_run(
            capacity in 1usize..12,
            inserts in prop::collection::vec((0u32..6, prop::collection::vec(0u64..8, 0..10)), 0..20),
            query in prop::collection::vec(0u64..8, 0..10),
        ) {
            let mut idx = ApproxPrefixIndex::new(capacity);
            for (r, chunks) in &inserts {
                idx.insert(ReplicaId(*r), chunks);
            }
            let mut got = idx.overlaps(&query);
            got.sort();
            let expected: Vec<(ReplicaId, usize)> = idx
                .per_replica
                .iter()
                .enumerate()
                .map(|(r, lru)| (ReplicaId(r as u32), query.iter().take_while(|&&c| lru.contains(c)).count()))
                .filter(|&(_, run)| run > 0)
                .collect();
            prop_assert_eq!(got, expected);
        }
    }
}
