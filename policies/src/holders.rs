//! The replicas holding one KV block, each with a value: the tiers it holds the block in, or
//! when the gateway's guess that it does expires. Inline while a single replica holds the
//! block (the usual case), so that a lookup in a large index touches one cache line and no
//! heap. A value equal to `T::default()` (no tier, expired at 0) means the replica is absent.

use crate::ReplicaId;

#[derive(Debug, Clone)]
pub enum Holders<T> {
    One(ReplicaId, T),
    Many(Vec<(ReplicaId, T)>),
}

impl<T: Copy + Default + PartialEq> Holders<T> {
    /// `replica`'s value (the default: it is not among them).
    pub fn get(&self, replica: ReplicaId) -> T {
        match self {
            Holders::One(r, v) if *r == replica => *v,
            Holders::One(..) => T::default(),
            Holders::Many(list) => list
                .iter()
                .find(|(r, _)| *r == replica)
                .map_or_else(T::default, |h| h.1),
        }
    }

    /// Sets `replica`'s value; the default removes it.
    pub fn set(&mut self, replica: ReplicaId, value: T) {
        let absent = value == T::default();
        match self {
            Holders::One(r, v) if *r == replica => {
                if absent {
                    *self = Holders::Many(Vec::new());
                } else {
                    *v = value;
                }
            }
            Holders::One(r, v) => {
                if !absent {
                    *self = Holders::Many(vec![(*r, *v), (replica, value)]);
                }
            }
            Holders::Many(list) => match list.iter().position(|(r, _)| *r == replica) {
                Some(i) if absent => {
                    list.swap_remove(i);
                }
                Some(i) => list[i].1 = value,
                None if !absent => list.push((replica, value)),
                None => {}
            },
        }
    }

    /// Keeps the replicas whose value passes `keep`.
    pub fn retain(&mut self, mut keep: impl FnMut(ReplicaId, T) -> bool) {
        match self {
            Holders::One(r, v) if !keep(*r, *v) => *self = Holders::Many(Vec::new()),
            Holders::One(..) => {}
            Holders::Many(list) => list.retain(|&(r, v)| keep(r, v)),
        }
    }

    pub fn is_empty(&self) -> bool {
        matches!(self, Holders::Many(list) if list.is_empty())
    }

    pub fn len(&self) -> usize {
        match self {
            Holders::One(..) => 1,
            Holders::Many(list) => list.len(),
        }
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
        let mut h = Holders::One(a, 1u8);
        h.set(b, 2);
        h.set(a, 3);
        assert_eq!((h.get(a), h.get(b)), (3, 2));
        assert_eq!(h.replicas().count(), 2);
        h.set(a, 0);
        h.set(b, 0);
        assert!(h.is_empty());
        let mut h = Holders::One(a, 1u8);
        h.set(b, 0);
        assert_eq!(h.get(a), 1, "removing a non-holder changes nothing");
        h.set(a, 0);
        assert!(h.is_empty() && h.replicas().next().is_none());
    }

    #[test]
    fn retain_keeps_those_that_pass() {
        let (a, b) = (ReplicaId(0), ReplicaId(1));
        let mut h = Holders::One(a, 200u64);
        h.retain(|_, expires| expires > 100);
        assert_eq!(h.get(a), 200);
        h.set(b, 50);
        h.retain(|_, expires| expires > 100);
        assert_eq!((h.get(a), h.get(b), h.len()), (200, 0, 1));
        h.retain(|_, expires| expires > 300);
        assert!(h.is_empty());
        let mut h = Holders::One(a, 50u64);
        h.retain(|_, expires| expires > 100);
        assert!(h.is_empty());
    }
}
