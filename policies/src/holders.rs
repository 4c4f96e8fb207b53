//! The replicas holding one KV block, each with the tiers it holds it in. Inline while a single
//! replica holds the block (the usual case), so that a lookup in a large index touches one
//! cache line and no heap.

use crate::ReplicaId;

/// A holder packed in one word, the replica above the tiers it holds the block in: words sort
/// in replica order, and two blocks' holder lists compare as plain memory.
pub type Holder = u64;

pub fn holder(replica: ReplicaId, tiers: u8) -> Holder {
    (u64::from(replica.0) << 32) | u64::from(tiers)
}

pub fn replica_of(holder: Holder) -> ReplicaId {
    ReplicaId((holder >> 32) as u32)
}

pub fn tiers_of(holder: Holder) -> u8 {
    holder as u8
}

/// In replica order, so that a walk over a prompt's blocks merges each block's holders with
/// the replicas whose run goes on.
#[derive(Debug, Clone)]
pub enum Holders {
    One(Holder),
    Many(Vec<Holder>),
}

impl Holders {
    /// The tiers `replica` holds the block in (0: none).
    pub fn tiers(&self, replica: ReplicaId) -> u8 {
        let list = self.entries();
        list.binary_search_by_key(&replica, |&h| replica_of(h))
            .map_or(0, |at| tiers_of(list[at]))
    }

    /// Sets the tiers `replica` holds the block in; 0 removes it.
    pub fn set(&mut self, replica: ReplicaId, tiers: u8) {
        if let Holders::One(one) = *self {
            if replica_of(one) == replica {
                *self = match tiers {
                    0 => Holders::Many(Vec::new()),
                    _ => Holders::One(holder(replica, tiers)),
                };
                return;
            }
            if tiers == 0 {
                return;
            }
            *self = Holders::Many(vec![one]);
        }
        if let Holders::Many(list) = self {
            match list.binary_search_by_key(&replica, |&h| replica_of(h)) {
                Ok(at) if tiers == 0 => {
                    list.remove(at);
                }
                Ok(at) => list[at] = holder(replica, tiers),
                Err(at) if tiers != 0 => list.insert(at, holder(replica, tiers)),
                Err(_) => {}
            }
        }
    }

    pub fn is_empty(&self) -> bool {
        self.entries().is_empty()
    }

    /// The holders, in replica order.
    pub fn entries(&self) -> &[Holder] {
        match self {
            Holders::One(one) => std::slice::from_ref(one),
            Holders::Many(list) => list,
        }
    }

    pub fn replicas(&self) -> impl Iterator<Item = ReplicaId> + '_ {
        self.entries().iter().map(|&h| replica_of(h))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_packed_holder_keeps_both_fields_and_sorts_by_replica() {
        let edges = [
            (0, 0),
            (0, u8::MAX),
            (1, 1),
            (u32::MAX, 0),
            (u32::MAX, u8::MAX),
        ];
        for (r, t) in edges {
            let h = holder(ReplicaId(r), t);
            assert_eq!((replica_of(h), tiers_of(h)), (ReplicaId(r), t));
        }
        assert!(holder(ReplicaId(1), 0) > holder(ReplicaId(0), u8::MAX));
    }

    #[test]
    fn grows_and_shrinks() {
        let (a, b) = (ReplicaId(0), ReplicaId(1));
        let mut h = Holders::One(holder(a, 1));
        h.set(b, 2);
        h.set(a, 3);
        assert_eq!((h.tiers(a), h.tiers(b)), (3, 2));
        assert_eq!(h.replicas().count(), 2);
        h.set(a, 0);
        h.set(b, 0);
        assert!(h.is_empty());
        let mut h = Holders::One(holder(a, 1));
        h.set(b, 0);
        assert_eq!(h.tiers(a), 1, "removing a non-holder changes nothing");
        h.set(a, 0);
        assert!(h.is_empty() && h.replicas().next().is_none());
    }
}
