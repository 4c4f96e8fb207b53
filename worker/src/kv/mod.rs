//! KV-cache management: the block pool, per-request block tables, the prefix cache.
//!
//! The scheduler sees a narrow interface (as in vLLM V1): [`KvManager::cached_prefix`],
//! [`KvManager::allocate`], [`KvManager::commit`], and freeing, which happens when a
//! request's [`KvBlocks`] is dropped, so an aborted or failed request cannot leak a block.

mod pool;

pub use pool::{BlockId, BlockPool};

use crate::request::Request;
use kvgate_protocol::kv_events::KvEvent;
use kvgate_protocol::{extend_block_hashes, HashSeed};
use std::cell::RefCell;
use std::rc::Rc;

/// A request's block table. Dropping it releases the blocks, last block first, so the tail of
/// a cached chain is evicted before its head.
#[derive(Debug)]
pub struct KvBlocks {
    pool: Rc<RefCell<BlockPool>>,
    ids: Vec<BlockId>,
    /// Leading blocks already cached (their hash registered).
    num_cached: usize,
}

impl KvBlocks {
    pub fn ids(&self) -> &[BlockId] {
        &self.ids
    }
}

impl Drop for KvBlocks {
    fn drop(&mut self) {
        let mut pool = self.pool.borrow_mut();
        for &id in self.ids.iter().rev() {
            pool.release(id);
        }
    }
}

pub struct KvManager {
    pool: Rc<RefCell<BlockPool>>,
    block_size: usize,
    seed: HashSeed,
    prefix_caching: bool,
}

impl KvManager {
    /// `num_blocks` usable blocks of `block_size` tokens; block hashes seeded with `seed`.
    pub fn new(num_blocks: usize, block_size: usize, seed: HashSeed, prefix_caching: bool) -> Self {
        KvManager {
            pool: Rc::new(RefCell::new(BlockPool::new(num_blocks + 1))),
            block_size: block_size.max(1),
            seed,
            prefix_caching,
        }
    }

    /// A copy with a pool of its own, and `blocks` re-pointed at it: a request's table in this
    /// manager's pool becomes the same table in the copy's.
    pub fn fork(&self) -> KvManager {
        KvManager {
            pool: Rc::new(RefCell::new(self.pool.borrow().clone())),
            block_size: self.block_size,
            seed: self.seed,
            prefix_caching: self.prefix_caching,
        }
    }

    /// `blocks` (a table in another manager's pool that this one was forked from) in this
    /// manager's pool. The copied pool already counts the references.
    pub fn adopt(&self, blocks: &KvBlocks) -> KvBlocks {
        KvBlocks {
            pool: Rc::clone(&self.pool),
            ids: blocks.ids.clone(),
            num_cached: blocks.num_cached,
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn seed(&self) -> HashSeed {
        self.seed
    }

    /// An empty block table.
    pub fn empty_blocks(&self) -> KvBlocks {
        KvBlocks {
            pool: Rc::clone(&self.pool),
            ids: Vec::new(),
            num_cached: 0,
        }
    }

    pub fn free_blocks(&self) -> usize {
        self.pool.borrow().free_blocks()
    }

    pub fn total_blocks(&self) -> usize {
        self.pool.borrow().total_blocks()
    }

    pub fn cached_blocks(&self) -> usize {
        self.pool.borrow().cached_blocks()
    }

    pub fn cached_hashes(&self) -> Vec<u64> {
        self.pool.borrow().cached_hashes()
    }

    pub fn take_events(&self) -> Vec<KvEvent> {
        self.pool.borrow_mut().take_events()
    }

    pub fn clear_cache(&self) {
        self.pool.borrow_mut().clear_cache();
    }

    /// Extends the request's block hashes over its full blocks.
    pub fn update_hashes(&self, req: &mut Request) {
        extend_block_hashes(
            self.seed,
            &req.tokens,
            self.block_size,
            &mut req.block_hashes,
        );
    }

    /// For a request with nothing computed: takes the longest run of its leading blocks that
    /// the cache holds into its block table and returns the tokens they cover. A hit never
    /// covers the last token, whose logits are needed.
    pub fn cached_prefix(&self, req: &mut Request) -> usize {
        if !self.prefix_caching || req.num_computed_tokens > 0 || !req.kv.ids.is_empty() {
            return 0;
        }
        let max_blocks = req.tokens.len().saturating_sub(1) / self.block_size;
        let mut pool = self.pool.borrow_mut();
        for &hash in req.block_hashes.iter().take(max_blocks) {
            match pool.touch(hash) {
                Some(id) => req.kv.ids.push(id),
                None => break,
            }
        }
        req.kv.num_cached = req.kv.ids.len();
        req.kv.ids.len() * self.block_size
    }

    /// Makes the block table cover `num_new` more tokens beyond those computed. All or
    /// nothing: false if the pool has too few free blocks.
    pub fn allocate(&self, req: &mut Request, num_new: usize) -> bool {
        let needed = (req.num_computed_tokens + num_new).div_ceil(self.block_size);
        let missing = needed.saturating_sub(req.kv.ids.len());
        let mut pool = self.pool.borrow_mut();
        if pool.free_blocks() < missing {
            return false;
        }
        for _ in 0..missing {
            match pool.allocate() {
                Some(id) => req.kv.ids.push(id),
                None => return false,
            }
        }
        true
    }

    /// Registers the blocks that are now full of computed tokens in the prefix cache.
    pub fn commit(&self, req: &mut Request) {
        if !self.prefix_caching {
            return;
        }
        let full = (req.num_computed_tokens / self.block_size)
            .min(req.block_hashes.len())
            .min(req.kv.ids.len());
        let mut pool = self.pool.borrow_mut();
        for i in req.kv.num_cached..full {
            let parent = i.checked_sub(1).map(|p| req.block_hashes[p]);
            pool.cache(req.kv.ids[i], req.block_hashes[i], parent);
        }
        req.kv.num_cached = req.kv.num_cached.max(full);
    }

    /// Shrinks the block table to the blocks holding its first `tokens` tokens, last block
    /// first: the positions of a rejected draft go back. Cached blocks are never among them
    /// (only blocks full of verified, computed tokens are cached).
    pub fn truncate(&self, req: &mut Request, tokens: usize) {
        let keep = tokens.div_ceil(self.block_size).max(req.kv.num_cached);
        let mut pool = self.pool.borrow_mut();
        while req.kv.ids.len() > keep {
            if let Some(id) = req.kv.ids.pop() {
                pool.release(id);
            }
        }
    }

    /// Releases every block of the request (it was preempted or finished).
    pub fn free(&self, req: &mut Request) {
        req.kv = self.empty_blocks();
    }

    /// Checks the pool against the block tables of `requests`: for tests.
    pub fn check<'a>(&self, requests: impl Iterator<Item = &'a Request>) -> Result<(), String> {
        let pool = self.pool.borrow();
        let mut expected = vec![0u32; pool.total_blocks() + 1];
        for r in requests {
            for &id in &r.kv.ids {
                expected[id as usize] += 1;
            }
        }
        pool.check(&expected)
    }
}
