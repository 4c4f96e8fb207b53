//! The offload tier: KV blocks evicted from the device pool, kept in host memory by the hash the
//! gateway and worker share, so that a returning prefix is loaded back instead of recomputed.
//! Bounded in bytes, least recently used evicted first (to the disk tier below, when there is
//! one); each entry keeps its parent's hash so that KV events can announce it as part of its
//! chain.

use super::disk_tier::DiskTier;
use kvgate_protocol::kv_events::{KvEvent, Tier};
use lru::LruCache;
use std::sync::Arc;

/// One block's K/V as the backend exported it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Offloaded {
    pub parent: Option<u64>,
    /// Shared with the loads that copy it back (the tier may drop it meanwhile); empty from a
    /// backend that only models K/V.
    pub data: Arc<[u8]>,
    /// What it takes of the tier: its K/V's size, modelled or real.
    pub bytes: usize,
}

#[derive(Debug)]
pub struct OffloadTier {
    capacity_bytes: usize,
    used_bytes: usize,
    blocks: LruCache<u64, Offloaded>,
    events: Vec<KvEvent>,
    disk: Option<DiskTier>,
}

/// A copy of the host tier, without the disk tier, whose files only the original may touch
/// (copies serve look-ahead).
impl Clone for OffloadTier {
    fn clone(&self) -> Self {
        OffloadTier {
            capacity_bytes: self.capacity_bytes,
            used_bytes: self.used_bytes,
            blocks: self.blocks.clone(),
            events: self.events.clone(),
            disk: None,
        }
    }
}

impl OffloadTier {
    pub fn new(capacity_bytes: usize) -> Self {
        OffloadTier {
            capacity_bytes,
            used_bytes: 0,
            blocks: LruCache::unbounded(),
            events: Vec::new(),
            disk: None,
        }
    }

    /// Blocks this tier evicts go on to `disk`.
    pub fn set_disk(&mut self, disk: DiskTier) {
        self.disk = Some(disk);
    }

    pub fn disk(&self) -> Option<&DiskTier> {
        self.disk.as_ref()
    }

    pub fn capacity_bytes(&self) -> usize {
        self.capacity_bytes
    }

    pub fn used_bytes(&self) -> usize {
        self.used_bytes
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    pub fn contains(&self, hash: u64) -> bool {
        self.blocks.contains(&hash)
    }

    /// Keeps a block, evicting the least recently used ones to make room. A block larger than
    /// the whole tier is not kept; one already held is only refreshed.
    pub fn put(&mut self, hash: u64, block: Offloaded) {
        let size = block.bytes;
        if size > self.capacity_bytes {
            return;
        }
        if self.blocks.get(&hash).is_some() {
            return;
        }
        while self.used_bytes + size > self.capacity_bytes {
            let Some((old, evicted)) = self.blocks.pop_lru() else {
                break;
            };
            self.used_bytes -= evicted.bytes;
            self.events.push(KvEvent::Removed {
                hashes: vec![old],
                tier: Tier::Host,
            });
            if let Some(disk) = &mut self.disk {
                disk.put(old, &evicted);
            }
        }
        self.used_bytes += size;
        self.events.push(KvEvent::Stored {
            hashes: vec![hash],
            parent: block.parent,
            tier: Tier::Host,
        });
        self.blocks.put(hash, block);
    }

    /// The contents of block `hash` from host memory, else (with `from_disk`) read back from
    /// the disk tier; and the tier it came from.
    pub fn fetch(&mut self, hash: u64, from_disk: bool) -> Option<(Arc<[u8]>, Tier)> {
        if let Some(block) = self.blocks.get(&hash) {
            return Some((Arc::clone(&block.data), Tier::Host));
        }
        let disk = self.disk.as_mut().filter(|_| from_disk)?;
        disk.load(hash).map(|b| (b.data, Tier::Disk))
    }

    /// Forgets every block (a reset).
    pub fn clear(&mut self) {
        if !self.blocks.is_empty() {
            let hashes = self.blocks.iter().map(|(&h, _)| h).collect();
            self.events.push(KvEvent::Removed {
                hashes,
                tier: Tier::Host,
            });
        }
        self.blocks.clear();
        self.used_bytes = 0;
        if let Some(disk) = &mut self.disk {
            disk.clear();
        }
    }

    /// Every held hash (a snapshot for KV-event subscribers).
    pub fn hashes(&self) -> Vec<u64> {
        self.blocks.iter().map(|(&h, _)| h).collect()
    }

    /// The disk tier's hashes (a snapshot).
    pub fn disk_hashes(&self) -> Vec<u64> {
        self.disk.as_ref().map_or_else(Vec::new, DiskTier::hashes)
    }

    /// Events since the last call: the host tier's, then the disk tier's.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        let mut events = std::mem::take(&mut self.events);
        if let Some(disk) = &mut self.disk {
            events.extend(disk.take_events());
        }
        events
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(parent: Option<u64>, size: usize) -> Offloaded {
        Offloaded {
            parent,
            data: vec![size as u8; size].into(),
            bytes: size,
        }
    }

    #[test]
    fn the_least_recently_used_block_goes_first_and_bytes_stay_bounded() {
        let mut tier = OffloadTier::new(300);
        tier.put(1, block(None, 100));
        tier.put(2, block(Some(1), 100));
        tier.put(3, block(Some(2), 100));
        assert_eq!(tier.used_bytes(), 300);
        assert!(tier.fetch(1, false).is_some()); // 2 is now the oldest
        tier.put(4, block(Some(3), 100));
        assert!(!tier.contains(2) && tier.contains(1) && tier.contains(4));
        assert_eq!(tier.used_bytes(), 300);
        let events = tier.take_events();
        assert_eq!(
            events.last(),
            Some(&KvEvent::Stored {
                hashes: vec![4],
                parent: Some(3),
                tier: Tier::Host
            })
        );
        assert!(events.contains(&KvEvent::Removed {
            hashes: vec![2],
            tier: Tier::Host
        }));
    }

    #[test]
    fn a_block_larger_than_the_tier_or_already_held_changes_nothing() {
        let mut tier = OffloadTier::new(100);
        tier.put(1, block(None, 80));
        tier.put(2, block(None, 101));
        tier.put(1, block(None, 80));
        assert_eq!((tier.len(), tier.used_bytes()), (1, 80));
        assert_eq!(tier.take_events().len(), 1);
        tier.clear();
        assert!(tier.is_empty() && tier.used_bytes() == 0);
    }
}
