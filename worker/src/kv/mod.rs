//! KV-cache management: the block pool, per-request block tables, the prefix cache.
//!
//! The scheduler sees a narrow interface (as in vLLM V1): [`KvManager::cached_prefix`],
//! [`KvManager::allocate`], [`KvManager::commit`], and freeing, which happens when a
//! request's [`KvBlocks`] is dropped, so an aborted or failed request cannot leak a block.

mod disk_tier;
mod offload;
mod pool;

pub use disk_tier::DiskTier;
pub use offload::{OffloadTier, Offloaded};
pub use pool::{BlockId, BlockPool, Evicted};

use crate::request::Request;
use kvgate_protocol::kv_events::{KvEvent, Tier};
use kvgate_protocol::{extend_block_hashes, HashSeed};
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::Arc;

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
    /// Blocks evicted from the pool, kept in host memory (off until `enable_offload`).
    tier: Option<RefCell<OffloadTier>>,
    /// Blocks taken for prefixes the tier holds, to be written before the next step runs.
    loads: RefCell<Vec<Load>>,
    /// Whether loading a block back costs less than computing it again (the backend times it).
    loads_pay: Cell<bool>,
    /// The same for a block read back from the disk tier first.
    disk_loads_pay: Cell<bool>,
}

/// A block to fill from the offload tier before the step that reads it.
#[derive(Debug, Clone)]
pub struct Load {
    pub id: BlockId,
    pub data: Arc<[u8]>,
    /// The tier it was read from: host or disk.
    pub from: Tier,
}

impl KvManager {
    /// `num_blocks` usable blocks of `block_size` tokens; block hashes seeded with `seed`.
    pub fn new(num_blocks: usize, block_size: usize, seed: HashSeed, prefix_caching: bool) -> Self {
        KvManager {
            pool: Rc::new(RefCell::new(BlockPool::new(num_blocks + 1))),
            block_size: block_size.max(1),
            seed,
            prefix_caching,
            tier: None,
            loads: RefCell::default(),
            loads_pay: Cell::new(true),
            disk_loads_pay: Cell::new(false),
        }
    }

    /// Puts `disk` below the host tier: the blocks it evicts go there, and prefixes found
    /// there are read back while `pays` (cheaper than computing them). Refused without a host
    /// tier (see [`KvManager::enable_offload`]).
    pub fn enable_disk_tier(&self, disk: DiskTier, pays: bool) -> Result<(), String> {
        let Some(tier) = &self.tier else {
            return Err("a disk tier sits below the host tier, which is off".into());
        };
        tier.borrow_mut().set_disk(disk);
        self.disk_loads_pay.set(pays);
        Ok(())
    }

    /// `read` of the disk tier, if there is one.
    pub fn with_disk_tier<R>(&self, read: impl FnOnce(&DiskTier) -> R) -> Option<R> {
        let tier = self.tier.as_ref()?.borrow();
        tier.disk().map(read)
    }

    pub fn disk_hashes(&self) -> Vec<u64> {
        self.tier
            .as_ref()
            .map_or_else(Vec::new, |t| t.borrow().disk_hashes())
    }

    /// Keeps evicted cached blocks in a host tier of `capacity_bytes` (with prefix caching).
    pub fn enable_offload(&mut self, capacity_bytes: usize) {
        if self.prefix_caching && capacity_bytes > 0 {
            self.pool.borrow_mut().keep_evicted();
            self.tier = Some(RefCell::new(OffloadTier::new(capacity_bytes)));
        }
    }

    pub fn offload_enabled(&self) -> bool {
        self.tier.is_some()
    }

    /// The cached blocks evicted from the pool since the last call, whose contents the
    /// backend still holds: to export before the next step writes them.
    pub fn take_evicted(&self) -> Vec<Evicted> {
        self.pool.borrow_mut().take_evicted()
    }

    /// Keeps an evicted block's contents (`bytes` of K/V, modelled where `data` is empty) in
    /// the tier.
    pub fn offload(&self, evicted: Evicted, data: Vec<u8>, bytes: usize) {
        self.stage(evicted.hash, evicted.parent, data.into(), bytes);
    }

    /// Keeps block `hash`'s contents, computed elsewhere, in the tier (false without one).
    pub fn stage(&self, hash: u64, parent: Option<u64>, data: Arc<[u8]>, bytes: usize) -> bool {
        let Some(tier) = &self.tier else {
            return false;
        };
        let block = Offloaded {
            parent,
            data,
            bytes,
        };
        tier.borrow_mut().put(hash, block);
        true
    }

    /// Whether the pool or the host tier holds block `hash`.
    pub fn holds(&self, hash: u64) -> bool {
        self.pool.borrow().contains(hash)
            || self
                .tier
                .as_ref()
                .is_some_and(|t| t.borrow().contains(hash))
    }

    /// Block `hash`'s place in the pool, while cached there.
    pub fn cached_block(&self, hash: u64) -> Option<BlockId> {
        self.pool.borrow().cached_block(hash)
    }

    /// Block `hash`'s contents from the host tier (or the disk tier below it).
    pub fn fetch_offloaded(&self, hash: u64) -> Option<Arc<[u8]>> {
        let mut tier = self.tier.as_ref()?.borrow_mut();
        tier.fetch(hash, true).map(|(data, _)| data)
    }

    /// The blocks to fill from the tier before the next step.
    pub fn take_loads(&self) -> Vec<Load> {
        std::mem::take(&mut *self.loads.borrow_mut())
    }

    /// Whether prefixes found only in the tier are loaded back (else they are recomputed).
    pub fn set_loads_pay(&self, pay: bool) {
        self.loads_pay.set(pay);
    }

    /// The tier's blocks and bytes.
    pub fn offload_usage(&self) -> (usize, usize) {
        self.tier.as_ref().map_or((0, 0), |t| {
            let t = t.borrow();
            (t.len(), t.used_bytes())
        })
    }

    /// A copy with a pool of its own, and `blocks` re-pointed at it: a request's table in this
    /// manager's pool becomes the same table in the copy's.
    pub fn fork(&self) -> KvManager {
        KvManager {
            pool: Rc::new(RefCell::new(self.pool.borrow().clone())),
            block_size: self.block_size,
            seed: self.seed,
            prefix_caching: self.prefix_caching,
            tier: self.tier.clone(),
            loads: self.loads.clone(),
            loads_pay: self.loads_pay.clone(),
            disk_loads_pay: Cell::new(false),
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

    pub fn offloaded_hashes(&self) -> Vec<u64> {
        self.tier
            .as_ref()
            .map_or_else(Vec::new, |t| t.borrow().hashes())
    }

    /// Events since the last call: the pool's, then the tier's.
    pub fn take_events(&self) -> Vec<KvEvent> {
        let mut events = self.pool.borrow_mut().take_events();
        if let Some(tier) = &self.tier {
            events.extend(tier.borrow_mut().take_events());
        }
        events
    }

    pub fn clear_cache(&self) {
        self.pool.borrow_mut().clear_cache();
        if let Some(tier) = &self.tier {
            tier.borrow_mut().clear();
        }
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
    /// the cache holds into its block table and returns the tokens they cover: the pool's
    /// blocks first, then fresh blocks for those the offload tier holds (filled from it before
    /// the next step, see [`KvManager::take_loads`]). A hit never covers the last token, whose
    /// logits are needed.
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
        if let (Some(tier), true) = (&self.tier, self.loads_pay.get()) {
            let mut tier = tier.borrow_mut();
            let mut loads = self.loads.borrow_mut();
            // Loaded blocks are registered by `commit` once the step that follows has run.
            for &hash in &req.block_hashes[req.kv.ids.len()..max_blocks.min(req.block_hashes.len())]
            {
                if pool.free_blocks() == 0 {
                    break;
                }
                let Some((data, from)) = tier.fetch(hash, self.disk_loads_pay.get()) else {
                    break;
                };
                let Some(id) = pool.allocate() else { break };
                req.kv.ids.push(id);
                loads.push(Load { id, data, from });
            }
        }
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

    /// Releases every block of the request (it was preempted or finished); loads planned
    /// into them are dropped.
    pub fn free(&self, req: &mut Request) {
        self.loads
            .borrow_mut()
            .retain(|load| !req.kv.ids.contains(&load.id));
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
