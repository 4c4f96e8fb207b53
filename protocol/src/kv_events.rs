//! KV-cache events: how a worker tells the gateway which prefix blocks it holds. Versioned and
//! sequence-numbered, so a subscriber can detect a gap and resynchronise from a snapshot.

use serde::{Deserialize, Serialize};

/// Version of the event and snapshot formats below.
pub const KV_EVENTS_VERSION: u32 = 1;

/// Where a block lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Tier {
    Device,
    Host,
    /// Files on the worker's disk (`--kv-offload-dir`), below the host tier.
    Disk,
}

/// One change to a worker's set of cached blocks (hashes from [`crate::block_hashes`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum KvEvent {
    /// Full blocks became reusable; `parent` is the hash of the block before the first one.
    Stored {
        hashes: Vec<u64>,
        parent: Option<u64>,
        tier: Tier,
    },
    /// Blocks were evicted.
    Removed { hashes: Vec<u64>, tier: Tier },
    /// Everything was dropped (restart or reset).
    AllCleared,
}

/// The events of one engine step, with the sequence number of the batch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvEventBatch {
    pub version: u32,
    pub seq: u64,
    pub events: Vec<KvEvent>,
}

/// Every cached block at the moment after batch `seq`: replaying batches `seq + 1..` on top of
/// it reproduces the worker's state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvSnapshot {
    pub version: u32,
    pub seq: u64,
    pub block_size: usize,
    /// Blocks in device memory.
    pub hashes: Vec<u64>,
    /// Blocks offloaded to host memory.
    #[serde(default)]
    pub host_hashes: Vec<u64>,
    /// Blocks offloaded to disk.
    #[serde(default)]
    pub disk_hashes: Vec<u64>,
}

/// Applies a batch to a set of block hashes (the subscriber's side).
pub fn apply(set: &mut std::collections::HashSet<u64>, batch: &KvEventBatch) {
    for event in &batch.events {
        match event {
            KvEvent::Stored { hashes, .. } => set.extend(hashes.iter().copied()),
            KvEvent::Removed { hashes, .. } => {
                for h in hashes {
                    set.remove(h);
                }
            }
            KvEvent::AllCleared => set.clear(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_serialize_with_a_type_tag() {
        let e = KvEvent::Stored {
            hashes: vec![1, 2],
            parent: None,
            tier: Tier::Device,
        };
        let json = serde_json::to_string(&e).unwrap();
        assert_eq!(
            json,
            r#"{"type":"stored","hashes":[1,2],"parent":null,"tier":"device"}"#
        );
        let mut set = Default::default();
        let batch = KvEventBatch {
            version: KV_EVENTS_VERSION,
            seq: 1,
            events: vec![
                e,
                KvEvent::Removed {
                    hashes: vec![1],
                    tier: Tier::Device,
                },
            ],
        };
        apply(&mut set, &batch);
        assert_eq!(set.into_iter().collect::<Vec<_>>(), vec![2]);
    }
}
