//! The block pool: every KV block's reference count and cached hash, and the free list.
//!
//! The free list is intrusive and doubly linked (O(1) everywhere). It holds never-used blocks
//! and evictable cached blocks (reference count 0, hash kept): a freed cached block goes to the
//! tail, so the least recently used is evicted first; a freed uncached block goes to the head,
//! so it is reused before any cached one. Allocation pops the head and drops its hash then.
//! Block 0 is a null placeholder that is never handed out.

use kvgate_protocol::kv_events::{KvEvent, Tier};
use kvgate_protocol::HashKeyMap;

/// Index of a block in the pool.
pub type BlockId = u32;

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
struct Block {
    ref_count: u32,
    hash: Option<u64>,
    /// The hash of the block before this one in its chain, while `hash` is set.
    parent: Option<u64>,
    prev: u32,
    next: u32,
    free: bool,
}

#[derive(Debug, Clone)]
pub struct BlockPool {
    blocks: Vec<Block>,
    head: u32,
    tail: u32,
    free_count: usize,
    by_hash: HashKeyMap<BlockId>,
    events: Vec<KvEvent>,
    /// Cached blocks taken for reuse since the last call to `take_evicted`, while kept.
    evicted: Option<Vec<Evicted>>,
}

/// A cached block given up for reuse: its contents are intact until the next step writes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Evicted {
    pub id: BlockId,
    pub hash: u64,
    pub parent: Option<u64>,
}

impl BlockPool {
    /// A pool of `num_blocks` blocks, the first of them the null block.
    pub fn new(num_blocks: usize) -> Self {
        let mut pool = BlockPool {
            blocks: vec![
                Block {
                    ref_count: 0,
                    hash: None,
                    parent: None,
                    prev: NIL,
                    next: NIL,
                    free: false
                };
                num_blocks.max(1)
            ],
            head: NIL,
            tail: NIL,
            free_count: 0,
            by_hash: HashKeyMap::default(),
            events: Vec::new(),
            evicted: None,
        };
        for id in 1..pool.blocks.len() as u32 {
            pool.push_tail(id);
        }
        pool
    }

    /// Blocks that can be handed out (free, including evictable cached ones).
    pub fn free_blocks(&self) -> usize {
        self.free_count
    }

    /// Usable blocks (all but the null block).
    pub fn total_blocks(&self) -> usize {
        self.blocks.len() - 1
    }

    pub fn cached_blocks(&self) -> usize {
        self.by_hash.len()
    }

    /// Every cached block hash (a snapshot for KV-event subscribers).
    pub fn cached_hashes(&self) -> Vec<u64> {
        self.by_hash.keys().copied().collect()
    }

    /// Takes a free block (evicting its cached hash, if any) with reference count 1.
    pub fn allocate(&mut self) -> Option<BlockId> {
        let id = self.head;
        if id == NIL {
            return None;
        }
        self.unlink(id);
        let parent = self.blocks[id as usize].parent.take();
        if let Some(hash) = self.blocks[id as usize].hash.take() {
            self.by_hash.remove(&hash);
            if let Some(evicted) = &mut self.evicted {
                evicted.push(Evicted { id, hash, parent });
            }
            self.events.push(KvEvent::Removed {
                hashes: vec![hash],
                tier: Tier::Device,
            });
        }
        self.blocks[id as usize].ref_count = 1;
        Some(id)
    }

    /// The cached block holding `hash`, with one more reference (a prefix-cache hit).
    pub fn touch(&mut self, hash: u64) -> Option<BlockId> {
        let id = *self.by_hash.get(&hash)?;
        if self.blocks[id as usize].free {
            self.unlink(id);
        }
        self.blocks[id as usize].ref_count += 1;
        Some(id)
    }

    /// The block holding `hash`, without taking a reference.
    pub fn cached_block(&self, hash: u64) -> Option<BlockId> {
        self.by_hash.get(&hash).copied()
    }

    pub fn contains(&self, hash: u64) -> bool {
        self.by_hash.contains_key(&hash)
    }

    /// Drops one reference; at zero the block becomes free (evictable if cached).
    pub fn release(&mut self, id: BlockId) {
        let block = &mut self.blocks[id as usize];
        debug_assert!(block.ref_count > 0, "double free of block {id}");
        block.ref_count = block.ref_count.saturating_sub(1);
        if block.ref_count == 0 {
            if block.hash.is_some() {
                self.push_tail(id);
            } else {
                self.push_head(id);
            }
        }
    }

    /// Marks a full block as holding `hash` (its contents are computed). Returns false if
    /// another block already holds that hash (the same prefix computed twice at once): this
    /// one then stays uncached.
    pub fn cache(&mut self, id: BlockId, hash: u64, parent: Option<u64>) -> bool {
        if self.by_hash.contains_key(&hash) || self.blocks[id as usize].hash.is_some() {
            return false;
        }
        self.blocks[id as usize].hash = Some(hash);
        self.blocks[id as usize].parent = parent;
        self.by_hash.insert(hash, id);
        match self.events.last_mut() {
            // Consecutive blocks of one chain become one event.
            Some(KvEvent::Stored { hashes, .. }) if hashes.last() == parent.as_ref() => {
                hashes.push(hash)
            }
            _ => self.events.push(KvEvent::Stored {
                hashes: vec![hash],
                parent,
                tier: Tier::Device,
            }),
        }
        true
    }

    /// From now on, remembers each cached block it gives up for reuse (an offload tier wants
    /// their contents).
    pub fn keep_evicted(&mut self) {
        self.evicted.get_or_insert_with(Vec::new);
    }

    /// The cached blocks given up for reuse since the last call.
    pub fn take_evicted(&mut self) -> Vec<Evicted> {
        self.evicted
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Forgets every cached hash (a reset): nothing stale can be matched afterwards.
    pub fn clear_cache(&mut self) {
        for block in &mut self.blocks {
            block.hash = None;
            block.parent = None;
        }
        if let Some(evicted) = &mut self.evicted {
            evicted.clear();
        }
        self.by_hash.clear();
        self.events.push(KvEvent::AllCleared);
    }

    /// Events since the last call.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    pub fn ref_count(&self, id: BlockId) -> u32 {
        self.blocks[id as usize].ref_count
    }

    /// Checks the pool's internal invariants against the reference counts the block tables
    /// imply (`expected[id]`): for tests.
    pub fn check(&self, expected: &[u32]) -> Result<(), String> {
        let mut free = 0;
        let mut cursor = self.head;
        let mut prev = NIL;
        while cursor != NIL {
            let b = &self.blocks[cursor as usize];
            if !b.free || b.ref_count != 0 || b.prev != prev {
                return Err(format!("free list corrupt at block {cursor}"));
            }
            free += 1;
            prev = cursor;
            cursor = b.next;
        }
        if free != self.free_count || prev != self.tail {
            return Err(format!(
                "free count {} but list has {free}",
                self.free_count
            ));
        }
        for (id, b) in self.blocks.iter().enumerate().skip(1) {
            let want = expected.get(id).copied().unwrap_or(0);
            if b.ref_count != want {
                return Err(format!(
                    "block {id}: ref count {} but tables hold {want}",
                    b.ref_count
                ));
            }
            if (b.ref_count == 0) != b.free {
                return Err(format!(
                    "block {id}: ref count {} but free = {}",
                    b.ref_count, b.free
                ));
            }
            if let Some(h) = b.hash {
                if self.by_hash.get(&h) != Some(&(id as u32)) {
                    return Err(format!("block {id}: hash not indexed"));
                }
            }
        }
        if self
            .by_hash
            .values()
            .any(|&id| self.blocks[id as usize].hash.is_none())
        {
            return Err("index names a block without a hash".into());
        }
        Ok(())
    }

    fn unlink(&mut self, id: u32) {
        let (prev, next) = (self.blocks[id as usize].prev, self.blocks[id as usize].next);
        match prev {
            NIL => self.head = next,
            p => self.blocks[p as usize].next = next,
        }
        match next {
            NIL => self.tail = prev,
            n => self.blocks[n as usize].prev = prev,
        }
        let b = &mut self.blocks[id as usize];
        b.free = false;
        b.prev = NIL;
        b.next = NIL;
        self.free_count -= 1;
    }

    fn push_tail(&mut self, id: u32) {
        let old_tail = self.tail;
        let b = &mut self.blocks[id as usize];
        b.free = true;
        b.prev = old_tail;
        b.next = NIL;
        match old_tail {
            NIL => self.head = id,
            t => self.blocks[t as usize].next = id,
        }
        self.tail = id;
        self.free_count += 1;
    }

    fn push_head(&mut self, id: u32) {
        let old_head = self.head;
        let b = &mut self.blocks[id as usize];
        b.free = true;
        b.prev = NIL;
        b.next = old_head;
        match old_head {
            NIL => self.tail = id,
            h => self.blocks[h as usize].prev = id,
        }
        self.head = id;
        self.free_count += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cached_blocks_survive_free_and_are_evicted_lru_first() {
        let mut pool = BlockPool::new(4); // 3 usable
        let a = pool.allocate().unwrap();
        let b = pool.allocate().unwrap();
        assert!(pool.cache(a, 10, None) && pool.cache(b, 11, Some(10)));
        assert_eq!(
            pool.take_events(),
            vec![KvEvent::Stored {
                hashes: vec![10, 11],
                parent: None,
                tier: Tier::Device
            }]
        );
        pool.release(b);
        pool.release(a);
        assert_eq!(pool.free_blocks(), 3);
        // A hit pulls a cached block back out of the free list.
        assert_eq!(pool.touch(10), Some(a));
        assert_eq!(pool.free_blocks(), 2);
        // Allocation takes the never-used block first, then evicts the oldest cached one.
        let c = pool.allocate().unwrap();
        assert!(c != a && c != b);
        assert_eq!(pool.allocate(), Some(b));
        assert_eq!(
            pool.take_events(),
            vec![KvEvent::Removed {
                hashes: vec![11],
                tier: Tier::Device
            }]
        );
        assert_eq!(pool.allocate(), None);
        pool.check(&[0, 1, 1, 1]).unwrap();
    }

    #[test]
    fn evicted_blocks_are_remembered_with_their_parents_once_asked() {
        let mut pool = BlockPool::new(3); // 2 usable
        let (a, b) = (pool.allocate().unwrap(), pool.allocate().unwrap());
        assert!(pool.cache(a, 10, None) && pool.cache(b, 11, Some(10)));
        pool.release(b);
        pool.release(a);
        pool.allocate().unwrap();
        assert!(pool.take_evicted().is_empty(), "not asked yet");
        pool.keep_evicted();
        assert_eq!(pool.allocate(), Some(a));
        assert_eq!(
            pool.take_evicted(),
            vec![Evicted {
                id: a,
                hash: 10,
                parent: None
            }]
        );
        assert!(pool.take_evicted().is_empty());
    }

    #[test]
    fn a_hash_is_cached_once() {
        let mut pool = BlockPool::new(3);
        let (a, b) = (pool.allocate().unwrap(), pool.allocate().unwrap());
        assert!(pool.cache(a, 7, None));
        assert!(!pool.cache(b, 7, None));
        assert_eq!(pool.cached_blocks(), 1);
    }
}
