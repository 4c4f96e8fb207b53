//! The replicas holding one KV block, each with the tiers it holds it in. Inline while a single
//! replica holds the block (the usual case), so that a lookup in a large index touches one
//! cache line and no heap.

use crate::ReplicaId;

#[derive(Debug, Clone)]
pub enum Holders {
    One(ReplicaId, u8),
    Many(Vec<(ReplicaId, u8)>),
}

impl Holders {
    /// The tiers `replica` holds the block in (0: none).
    pub fn tiers(&self, replica: ReplicaId) -> u8 {
        match self {
            Holders::One(r, t) => {
                if *r == replica {
                    *t
                } else {
                    0
                }
            }
            Holders::Many(list) => list.iter().find(|(r, _)| *r == replica).map_or(0, |h| h.1),
        }
    }

    /// Sets the tiers `replica` holds the block in; 0 removes it.
    pub fn set(&mut self, replica: ReplicaId, tiers: u8) {
        match self {
            Holders::One(r, t) if *r == replica => {
                if tiers == 0 {
                    *self = Holders::Many(Vec::new());
                } else {
                    *t = tiers;
                }
            }
            Holders::One(r, t) => {
                if tiers != 0 {
                    *self = Holders::Many(vec![(*r, *t), (replica, tiers)]);
                }
            }
            Holders::Many(list) => match list.iter().position(|(r, _)| *r == replica) {
                Some(i) if tiers == 0 => {
                    list.swap_remove(i);
                }
                Some(i) => list[i].1 = tiers,
                None if tiers != 0 => list.push((replica, tiers)),
                None => {}
            },
        }
    }

    pub fn is_empty(&self) -> bool {
        matches!(self, Holders::Many(list) if list.is_empty())
    }

    pub fn replicas(&self) -> impl Iterator<Item = ReplicaId> + '_ {
        let (one, many) = match self {
            Holders::One(r, _) => (Some(*r), &[][..]),
            Holders::Many(list) => (None, &list[..]),
        };
        one.into_iter().chain(many.iter().map(|h| h.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_and_shrinks() {
        let (a, b) = (ReplicaId(0), ReplicaId(1));
        let mut h = Holders::One(a, 1);
        h.set(b, 2);
        h.set(a, 3);
        assert_eq!((h.tiers(a), h.tiers(b)), (3, 2));
        assert_eq!(h.replicas().count(), 2);
        h.set(a, 0);
        h.set(b, 0);
        assert!(h.is_empty());
        let mut h = Holders::One(a, 1);
        h.set(b, 0);
        assert_eq!(h.tiers(a), 1, "removing a non-holder changes nothing");
        h.set(a, 0);
        assert!(h.is_empty() && h.replicas().next().is_none());
    }
}
