//! A fixed-capacity set of u64 keys with O(1) insert, touch and least-recently-used eviction:
//! a hash map into a slab of doubly linked nodes.

use kvgate_protocol::HashKeyMap;

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
struct Node {
    key: u64,
    prev: u32,
    next: u32,
}

#[derive(Debug, Clone)]
pub struct LruSet {
    capacity: usize,
    map: HashKeyMap<u32>,
    nodes: Vec<Node>,
    /// Most recently used.
    head: u32,
    /// Least recently used.
    tail: u32,
}

impl LruSet {
    pub fn new(capacity: usize) -> Self {
        LruSet {
            capacity: capacity.max(1),
            map: HashKeyMap::default(),
            nodes: Vec::new(),
            head: NIL,
            tail: NIL,
        }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn contains(&self, key: u64) -> bool {
        self.map.contains_key(&key)
    }

    /// Inserts or refreshes `key`; returns the key evicted to make room, if any.
    pub fn insert(&mut self, key: u64) -> Option<u64> {
        if let Some(&idx) = self.map.get(&key) {
            self.unlink(idx);
            self.push_front(idx);
            return None;
        }
        if self.map.len() < self.capacity {
            let idx = self.nodes.len() as u32;
            self.nodes.push(Node {
                key,
                prev: NIL,
                next: NIL,
            });
            self.map.insert(key, idx);
            self.push_front(idx);
            return None;
        }
        // Full: reuse the least recently used node for the new key.
        let idx = self.tail;
        self.unlink(idx);
        let old = std::mem::replace(&mut self.nodes[idx as usize].key, key);
        self.map.remove(&old);
        self.map.insert(key, idx);
        self.push_front(idx);
        Some(old)
    }

    /// Every key, in no particular order (to forget a replica's entries).
    pub fn keys(&self) -> impl Iterator<Item = u64> + '_ {
        self.map.keys().copied()
    }

    fn unlink(&mut self, idx: u32) {
        let (prev, next) = {
            let n = &self.nodes[idx as usize];
            (n.prev, n.next)
        };
        match prev {
            NIL => self.head = next,
            p => self.nodes[p as usize].next = next,
        }
        match next {
            NIL => self.tail = prev,
            n => self.nodes[n as usize].prev = prev,
        }
    }

    fn push_front(&mut self, idx: u32) {
        let old_head = self.head;
        {
            let n = &mut self.nodes[idx as usize];
            n.prev = NIL;
            n.next = old_head;
        }
        match old_head {
            NIL => self.tail = idx,
            h => self.nodes[h as usize].prev = idx,
        }
        self.head = idx;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn evicts_least_recently_used() {
        let mut lru = LruSet::new(2);
        assert_eq!(lru.insert(1), None);
        assert_eq!(lru.insert(2), None);
        assert_eq!(lru.insert(1), None); // touch 1: 2 is now oldest
        assert_eq!(lru.insert(3), Some(2));
        assert!(lru.contains(1) && lru.contains(3) && !lru.contains(2));
    }

    proptest! {
        #[test]
        fn matches_a_naive_model(keys in prop::collection::vec(0u64..20, 0..200), cap in 1usize..8) {
            let mut lru = LruSet::new(cap);
            let mut model: Vec<u64> = Vec::new(); // most recent last
            for k in keys {
                let evicted = lru.insert(k);
                let expected = if let Some(pos) = model.iter().position(|&x| x == k) {
                    model.remove(pos);
                    None
                } else if model.len() == cap {
                    Some(model.remove(0))
                } else {
                    None
                };
                model.push(k);
                prop_assert_eq!(evicted, expected);
                prop_assert_eq!(lru.len(), model.len());
            }
        }
    }
}
