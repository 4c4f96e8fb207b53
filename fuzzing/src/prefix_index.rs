//! The gateway's precise prefix index under any sequence of snapshots, event batches (in
//! order, repeated, with gaps), forgotten replicas and routing guesses: what it says each
//! replica holds of a prompt always equals a plain model of the events.

use arbitrary::{Arbitrary, Unstructured};
use kvgate_policies::{PreciseIndex, ReplicaId};
use kvgate_protocol::kv_events::{KvEvent, KvEventBatch, KvSnapshot, Tier, KV_EVENTS_VERSION};
use kvgate_protocol::telemetry::KvUpdate;
use std::collections::HashMap;

const REPLICAS: u8 = 4;

#[derive(Debug, Arbitrary)]
enum Op {
    Snapshot {
        replica: u8,
        seq: u8,
        device: Vec<u8>,
        host: Vec<u8>,
        disk: Vec<u8>,
        then: Vec<Batch>,
    },
    Batches {
        replica: u8,
        batches: Vec<Batch>,
    },
    Forget {
        replica: u8,
    },
    Guess {
        replica: u8,
        blocks: Vec<u8>,
        held: u8,
        now: u8,
        ttl: u8,
    },
    Query {
        blocks: Vec<u8>,
        now: u8,
    },
}

#[derive(Debug, Arbitrary)]
struct Batch {
    seq: u8,
    events: Vec<Event>,
}

#[derive(Debug, Arbitrary)]
enum Event {
    Stored { blocks: Vec<u8>, tier: u8 },
    Removed { blocks: Vec<u8>, tier: u8 },
    AllCleared,
}

/// What a replica holds by the events: hash → held in [device, host, disk], and its last
/// batch.
#[derive(Default, Clone)]
struct Held {
    blocks: HashMap<u64, [bool; 3]>,
    seq: Option<u64>,
}

fn hash(b: u8) -> u64 {
    u64::from(b).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

const TIERS: [Tier; 3] = [Tier::Device, Tier::Host, Tier::Disk];

fn tier(t: u8) -> Tier {
    TIERS[usize::from(t) % TIERS.len()]
}

fn slot(t: Tier) -> usize {
    TIERS.iter().position(|&x| x == t).unwrap_or(0)
}

impl Batch {
    fn to_wire(&self) -> KvEventBatch {
        let events = self
            .events
            .iter()
            .map(|e| match e {
                Event::Stored { blocks, tier: t } => KvEvent::Stored {
                    hashes: blocks.iter().copied().map(hash).collect(),
                    parent: None,
                    tier: tier(*t),
                },
                Event::Removed { blocks, tier: t } => KvEvent::Removed {
                    hashes: blocks.iter().copied().map(hash).collect(),
                    tier: tier(*t),
                },
                Event::AllCleared => KvEvent::AllCleared,
            })
            .collect();
        KvEventBatch {
            version: KV_EVENTS_VERSION,
            seq: u64::from(self.seq),
            events,
        }
    }
}

impl Held {
    /// The model's reading of an update: the snapshot replaces, batches apply in order, the
    /// first gap ends it. Whether a snapshot is wanted (a gap, or none yet).
    fn apply(&mut self, update: &KvUpdate) -> bool {
        if let Some(s) = &update.snapshot {
            *self = Held::default();
            for (t, hashes) in [&s.hashes, &s.host_hashes, &s.disk_hashes]
                .into_iter()
                .enumerate()
            {
                for &h in hashes {
                    self.blocks.entry(h).or_default()[t] = true;
                }
            }
            self.seq = Some(s.seq);
        }
        for batch in &update.batches {
            match self.seq {
                Some(seq) if batch.seq <= seq => continue,
                Some(seq) if batch.seq == seq + 1 => {}
                _ => return true,
            }
            for event in &batch.events {
                match event {
                    KvEvent::Stored { hashes, tier, .. } => {
                        for h in hashes {
                            self.blocks.entry(*h).or_default()[slot(*tier)] = true;
                        }
                    }
                    KvEvent::Removed { hashes, tier } => {
                        for h in hashes {
                            if let Some(e) = self.blocks.get_mut(h) {
                                e[slot(*tier)] = false;
                                if *e == [false; 3] {
                                    self.blocks.remove(h);
                                }
                            }
                        }
                    }
                    KvEvent::AllCleared => self.blocks.clear(),
                }
            }
            self.seq = Some(batch.seq);
        }
        self.seq.is_none()
    }

    /// The worth of the prompt's leading run held: 1 a device block, 0.5 a host block, 0.25
    /// a disk block (the defaults: no engine said otherwise).
    fn run(&self, hashes: &[u64]) -> f64 {
        let mut value = 0.0;
        for h in hashes {
            match self.blocks.get(h) {
                Some([true, _, _]) => value += 1.0,
                Some([false, true, _]) => value += 0.5,
                Some([false, false, true]) => value += 0.25,
                _ => break,
            }
        }
        value
    }
}

pub fn prefix_index(data: &[u8]) {
    let mut u = Unstructured::new(data);
    let Ok(ops) = Vec::<Op>::arbitrary(&mut u) else {
        return;
    };
    let mut index = PreciseIndex::default();
    let mut model = vec![Held::default(); usize::from(REPLICAS)];
    for op in ops {
        match op {
            Op::Snapshot {
                replica,
                seq,
                device,
                host,
                disk,
                then,
            } => {
                let update = KvUpdate {
                    snapshot: Some(KvSnapshot {
                        version: KV_EVENTS_VERSION,
                        seq: u64::from(seq),
                        block_size: 16,
                        hashes: device.into_iter().map(hash).collect(),
                        host_hashes: host.into_iter().map(hash).collect(),
                        disk_hashes: disk.into_iter().map(hash).collect(),
                    }),
                    batches: then.iter().map(Batch::to_wire).collect(),
                };
                let r = replica % REPLICAS;
                let applied = index.apply(ReplicaId(u32::from(r)), &update);
                assert_eq!(applied.needs_snapshot, model[usize::from(r)].apply(&update));
            }
            Op::Batches { replica, batches } => {
                let update = KvUpdate {
                    snapshot: None,
                    batches: batches.iter().map(Batch::to_wire).collect(),
                };
                let r = replica % REPLICAS;
                let applied = index.apply(ReplicaId(u32::from(r)), &update);
                assert_eq!(applied.needs_snapshot, model[usize::from(r)].apply(&update));
            }
            Op::Forget { replica } => {
                let r = replica % REPLICAS;
                index.clear_replica(ReplicaId(u32::from(r)));
                model[usize::from(r)] = Held::default();
            }
            Op::Guess {
                replica,
                blocks,
                held,
                now,
                ttl,
            } => {
                let hashes: Vec<u64> = blocks.into_iter().map(hash).collect();
                let (now, ttl) = (u64::from(now), u64::from(ttl));
                let r = ReplicaId(u32::from(replica % REPLICAS));
                index.assume(r, &hashes, usize::from(held), now, now + ttl);
                // With guesses counted, a replica is worth at least what it holds.
                let mut matched = vec![0.0; usize::from(REPLICAS)];
                index.overlaps(&hashes, now, &mut matched);
                for (r, m) in model.iter().zip(&matched) {
                    assert!(*m >= r.run(&hashes), "{m} below {}", r.run(&hashes));
                }
            }
            Op::Query { blocks, now } => {
                let hashes: Vec<u64> = blocks.into_iter().map(hash).collect();
                // Past every guess's expiry, only events count: exactly the model's runs.
                let mut matched = vec![0.0; usize::from(REPLICAS)];
                index.overlaps(&hashes, 1 << 20, &mut matched);
                let expected: Vec<f64> = model.iter().map(|r| r.run(&hashes)).collect();
                assert_eq!(matched, expected, "{hashes:?}");
                let mut with_guesses = vec![0.0; usize::from(REPLICAS)];
                index.overlaps(&hashes, u64::from(now), &mut with_guesses);
            }
        }
        let held: usize = model.iter().map(|r| r.blocks.len()).sum();
        assert_eq!(index.len(), held);
    }
}
