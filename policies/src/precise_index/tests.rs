use super::*;
use kvgate_protocol::kv_events::{Tier, KV_EVENTS_VERSION};

const A: ReplicaId = ReplicaId(0);
const B: ReplicaId = ReplicaId(1);

fn stored(seq: u64, hashes: &[u64], tier: Tier) -> KvEventBatch {
    KvEventBatch {
        version: KV_EVENTS_VERSION,
        seq,
        events: vec![KvEvent::Stored {
            hashes: hashes.to_vec(),
            parent: None,
            tier,
        }],
    }
}

fn snapshot(seq: u64, hashes: &[u64]) -> KvUpdate {
    KvUpdate {
        snapshot: Some(KvSnapshot {
            version: KV_EVENTS_VERSION,
            seq,
            block_size: 16,
            hashes: hashes.to_vec(),
            host_hashes: vec![],
            disk_hashes: vec![],
        }),
        batches: vec![],
    }
}

fn batches(b: Vec<KvEventBatch>) -> KvUpdate {
    KvUpdate {
        snapshot: None,
        batches: b,
    }
}

fn overlaps(idx: &PreciseIndex, hashes: &[u64], now: u64) -> Vec<f64> {
    overlaps_and_latest(idx, hashes, now).0
}

fn overlaps_and_latest(idx: &PreciseIndex, hashes: &[u64], now: u64) -> (Vec<f64>, Vec<f64>) {
    let (mut m, mut latest) = (vec![0.0; 2], vec![0.0; 2]);
    idx.overlaps_and_latest(hashes, now, &mut m, &mut latest);
    (m, latest)
}

#[test]
fn events_apply_in_sequence_and_a_gap_asks_for_a_snapshot() {
    let mut idx = PreciseIndex::default();
    let first = idx.apply(A, &batches(vec![stored(1, &[1], Tier::Device)]));
    assert!(first.needs_snapshot, "no snapshot yet");
    assert_eq!(first.batches, 0);
    assert!(!idx.apply(A, &snapshot(3, &[1, 2])).needs_snapshot);
    let ok = idx.apply(
        A,
        &batches(vec![
            stored(3, &[9], Tier::Device),
            stored(4, &[3], Tier::Device),
        ]),
    );
    assert_eq!(
        ok,
        Applied {
            batches: 1,
            needs_snapshot: false
        },
        "3 was in the snapshot"
    );
    assert_eq!(overlaps(&idx, &[1, 2, 3, 4], 0), vec![3.0, 0.0]);
    let gap = idx.apply(A, &batches(vec![stored(6, &[4], Tier::Device)]));
    assert!(gap.needs_snapshot);
    assert_eq!(
        overlaps(&idx, &[1, 2, 3, 4], 0),
        vec![3.0, 0.0],
        "nothing applied past a gap"
    );
    idx.apply(A, &snapshot(6, &[7]));
    assert_eq!(
        overlaps(&idx, &[1, 2, 3], 0),
        vec![0.0, 0.0],
        "the snapshot replaced it all"
    );
    assert_eq!(idx.len(), 1);
}

#[test]
fn a_host_block_is_worth_what_its_engine_measured() {
    let mut idx = PreciseIndex::default();
    for r in [A, B] {
        idx.apply(r, &snapshot(0, &[1]));
        idx.apply(r, &batches(vec![stored(1, &[2, 3], Tier::Host)]));
    }
    assert_eq!(
        overlaps(&idx, &[1, 2, 3], 0),
        vec![2.0, 2.0],
        "the default, half"
    );
    let host = |v| TierValues {
        host: v,
        disk: None,
    };
    idx.set_tier_values(A, host(Some(0.97)));
    idx.set_tier_values(B, host(Some(f64::NAN)));
    let got = overlaps(&idx, &[1, 2, 3], 0);
    assert!((got[0] - 2.94).abs() < 1e-9 && got[1] == 2.0, "{got:?}");
    idx.set_tier_values(B, host(Some(7.0)));
    idx.set_tier_values(A, host(None));
    assert_eq!(
        overlaps(&idx, &[1, 2, 3], 0),
        vec![2.0, 3.0],
        "clamped to a device block's worth; None is the default again"
    );
}

#[test]
fn a_disk_block_is_worth_what_its_engine_measured_below_the_host_tier() {
    let mut idx = PreciseIndex::default();
    for r in [A, B] {
        idx.apply(r, &snapshot(0, &[1]));
        idx.apply(
            r,
            &batches(vec![
                stored(1, &[2], Tier::Host),
                stored(2, &[3, 4], Tier::Disk),
            ]),
        );
    }
    assert_eq!(
        overlaps(&idx, &[1, 2, 3, 4], 0),
        vec![2.0, 2.0],
        "the defaults: a half and two quarters"
    );
    idx.set_tier_values(
        A,
        TierValues {
            host: Some(0.9),
            disk: Some(0.6),
        },
    );
    let got = overlaps(&idx, &[1, 2, 3, 4], 0);
    assert!((got[0] - 3.1).abs() < 1e-9 && got[1] == 2.0, "{got:?}");
    assert_eq!(
        idx.held_by_tier(&[1, 2, 3, 4, 5], A),
        HeldByTier {
            device: 1,
            host: 1,
            disk: 2
        }
    );
}

#[test]
fn tiers_and_removals() {
    let mut idx = PreciseIndex::default();
    idx.apply(A, &snapshot(0, &[1, 2]));
    idx.apply(B, &snapshot(0, &[1]));
    idx.apply(
        B,
        &batches(vec![
            stored(1, &[2], Tier::Device),
            stored(2, &[3], Tier::Host),
        ]),
    );
    assert_eq!(
        overlaps(&idx, &[1, 2, 3], 0),
        vec![2.0, 2.5],
        "a host block is worth half"
    );
    assert_eq!(
        idx.held_by_tier(&[1, 2, 3, 4], B),
        HeldByTier {
            device: 2,
            host: 1,
            disk: 0
        }
    );
    assert_eq!(
        idx.held_by_tier(&[1, 2, 3], A),
        HeldByTier {
            device: 2,
            host: 0,
            disk: 0
        }
    );
    let remove = KvEventBatch {
        version: KV_EVENTS_VERSION,
        seq: 3,
        events: vec![KvEvent::Removed {
            hashes: vec![2],
            tier: Tier::Device,
        }],
    };
    idx.apply(B, &batches(vec![remove]));
    assert_eq!(
        overlaps(&idx, &[1, 2, 3], 0),
        vec![2.0, 1.0],
        "the run ends at a removed block"
    );
    let cleared = KvEventBatch {
        version: KV_EVENTS_VERSION,
        seq: 1,
        events: vec![KvEvent::AllCleared],
    };
    assert!(!idx.apply(A, &batches(vec![cleared])).needs_snapshot);
    assert_eq!(overlaps(&idx, &[1], 0), vec![0.0, 1.0]);
    idx.clear_replica(B);
    assert!(idx.is_empty());
    assert!(
        idx.apply(B, &batches(vec![])).needs_snapshot,
        "a cleared replica resynchronises"
    );
}

#[test]
fn device_blocks_count_what_the_events_show_on_the_device() {
    let mut idx = PreciseIndex::default();
    assert_eq!(
        idx.device_blocks(A),
        None,
        "nothing known before a snapshot"
    );
    idx.apply(A, &snapshot(0, &[1, 2]));
    assert_eq!(idx.device_blocks(A), Some(2));
    idx.apply(
        A,
        &batches(vec![
            stored(1, &[2, 3], Tier::Device),
            stored(2, &[2, 4], Tier::Host),
        ]),
    );
    assert_eq!(
        idx.device_blocks(A),
        Some(3),
        "a block stored twice counts once"
    );
    let removed = |seq, hashes: &[u64], tier| KvEventBatch {
        version: KV_EVENTS_VERSION,
        seq,
        events: vec![KvEvent::Removed {
            hashes: hashes.to_vec(),
            tier,
        }],
    };
    // Block 2 leaves the device but stays on the host; block 4 was only ever on the host.
    idx.apply(
        A,
        &batches(vec![
            removed(3, &[2], Tier::Device),
            removed(4, &[4, 9], Tier::Host),
        ]),
    );
    assert_eq!(idx.device_blocks(A), Some(2));
    idx.apply(A, &snapshot(5, &[7]));
    assert_eq!(
        idx.device_blocks(A),
        Some(1),
        "a snapshot replaces the count"
    );
    idx.clear_replica(A);
    assert_eq!(idx.device_blocks(A), None);
}

#[test]
fn guesses_count_in_strides_until_they_expire() {
    let mut idx = PreciseIndex::default();
    let prompt: Vec<u64> = (1..=10).collect();
    idx.assume(A, &prompt, 0, 100, 200);
    assert_eq!(overlaps(&idx, &prompt, 150), vec![10.0, 0.0]);
    assert_eq!(
        overlaps(&idx, &prompt[..9], 150),
        vec![8.0, 0.0],
        "two whole strides"
    );
    assert_eq!(
        overlaps(&idx, &[1, 2, 3], 150),
        vec![0.0, 0.0],
        "no checkpoint reached"
    );
    idx.assume(B, &prompt[..4], 0, 190, 400);
    assert_eq!(
        overlaps(&idx, &prompt, 250),
        vec![0.0, 4.0],
        "A's guesses expired; B's renewed block 4"
    );
    idx.assume(B, &[99], 0, 250, 500);
    assert_eq!(
        idx.assumed_len(),
        2,
        "the next decision purges the expired guesses"
    );
    // Events and guesses: the longer run counts.
    idx.apply(A, &snapshot(0, &[1, 2, 3, 4, 5, 6]));
    assert_eq!(overlaps(&idx, &prompt, 250), vec![6.0, 4.0]);
    idx.clear_replica(B);
    assert_eq!(overlaps(&idx, &prompt, 250), vec![6.0, 0.0]);
    // A holds 6 from events; the decision guesses the rest only, and the run goes on
    // through events into guesses.
    idx.assume(A, &prompt, 6, 300, 600);
    assert_eq!(idx.assumed_len(), 2, "checkpoints 8 and 10 guessed, not 4");
    assert_eq!(overlaps(&idx, &prompt, 350), vec![10.0, 0.0]);
}

#[test]
fn a_snapshot_keeps_the_guesses_of_prompts_not_yet_computed() {
    let mut idx = PreciseIndex::default();
    let prompt: Vec<u64> = (1..=8).collect();
    idx.assume(A, &prompt, 0, 100, 200);
    // The replica's first report: a snapshot taken before it computed the prompt.
    idx.apply(A, &snapshot(0, &[42]));
    assert_eq!(overlaps(&idx, &prompt, 150), vec![8.0, 0.0]);
    let cleared = KvEventBatch {
        version: KV_EVENTS_VERSION,
        seq: 1,
        events: vec![KvEvent::AllCleared],
    };
    idx.apply(A, &batches(vec![cleared]));
    assert_eq!(overlaps(&idx, &prompt, 150), vec![8.0, 0.0]);
    idx.clear_replica(A);
    assert_eq!(
        overlaps(&idx, &prompt, 150),
        vec![0.0, 0.0],
        "a restarted replica lost its prompts"
    );
}

#[test]
fn a_prompt_sent_to_several_replicas_is_guessed_on_each() {
    let mut idx = PreciseIndex::default();
    let prompt: Vec<u64> = (1..=8).collect();
    idx.assume(A, &prompt, 0, 100, 300);
    idx.assume(B, &prompt, 0, 110, 310);
    assert_eq!(
        overlaps_and_latest(&idx, &prompt, 150),
        (vec![8.0, 8.0], vec![0.0, 8.0]),
        "each, and the latest decision's guess alone"
    );
    // A renewed guess is the latest again; each expires on its own.
    idx.assume(A, &prompt, 0, 120, 320);
    assert_eq!(overlaps_and_latest(&idx, &prompt, 150).1, vec![8.0, 0.0]);
    assert_eq!(overlaps(&idx, &prompt, 315), vec![8.0, 0.0]);
    idx.clear_replica(A);
    assert_eq!(overlaps(&idx, &prompt, 150), vec![0.0, 8.0]);
    assert_eq!(idx.assumed_len(), 2, "B's two checkpoints");
}

#[test]
fn past_the_bound_a_new_guess_replaces_the_one_due_first() {
    let mut idx = PreciseIndex::default();
    for r in 0..=GUESSES_PER_BLOCK as u32 {
        idx.assume(ReplicaId(r), &[7], 0, 0, 100 + u64::from(r));
    }
    assert_eq!(idx.assumed_len(), GUESSES_PER_BLOCK);
    let mut m = vec![0.0; GUESSES_PER_BLOCK + 1];
    idx.overlaps(&[7], 50, &mut m);
    assert_eq!(m[0], 0.0, "replica 0's guess was due first");
    assert!(m[1..].iter().all(|&v| v == 1.0), "{m:?}");
}

#[test]
fn blocks_stored_again_after_their_removal_count_as_recomputed() {
    let mut idx = PreciseIndex::default();
    let blocks: Vec<u64> = (1..=300).collect();
    let removed = |seq| KvEventBatch {
        version: KV_EVENTS_VERSION,
        seq,
        events: vec![KvEvent::Removed {
            hashes: blocks.clone(),
            tier: Tier::Device,
        }],
    };
    assert_eq!(idx.recompute_share(A), 0.0);
    idx.apply(A, &snapshot(0, &[]));
    idx.apply(A, &batches(vec![stored(1, &blocks, Tier::Device)]));
    assert_eq!(idx.recompute_share(A), 0.0, "first computed");
    // Offloaded to the host and loaded back is not a recompute.
    idx.apply(
        A,
        &batches(vec![removed(2), stored(3, &blocks, Tier::Host)]),
    );
    idx.apply(A, &batches(vec![stored(4, &blocks, Tier::Device)]));
    assert_eq!(idx.recompute_share(A), 0.0);
    // Evicted from every tier and computed again is.
    let gone = KvEventBatch {
        version: KV_EVENTS_VERSION,
        seq: 6,
        events: vec![KvEvent::Removed {
            hashes: blocks.clone(),
            tier: Tier::Host,
        }],
    };
    idx.apply(
        A,
        &batches(vec![removed(5), gone, stored(7, &blocks, Tier::Device)]),
    );
    let share = idx.recompute_share(A);
    assert!(share > 0.6, "{share}");
    assert_eq!(idx.recompute_share(B), 0.0);
    // New blocks computed after bring it down.
    let fresh: Vec<u64> = (1_000..1_300).collect();
    idx.apply(A, &batches(vec![stored(8, &fresh, Tier::Device)]));
    assert!(idx.recompute_share(A) < share / 2.0);
}

/// Each replica's worth by the definitions, one replica at a time: its leading run from events
/// (each block at its tier's value), carried on through the checkpoints guessed for it while
/// each checkpoint is guessed or within that run.
fn worth_by_definition(
    idx: &PreciseIndex,
    hashes: &[u64],
    now: u64,
    only_latest: bool,
    replica: ReplicaId,
) -> f64 {
    let (mut value, mut blocks) = (0.0, 0);
    for hash in hashes {
        let tiers = idx.holders.get(hash).map_or(0, |h| h.tiers(replica));
        let worth = idx.tier_values(replica).block_value(tiers);
        if worth <= 0.0 {
            break;
        }
        value += worth;
        blocks += 1;
    }
    let mut best = value;
    for i in (0..hashes.len()).filter(|&i| is_checkpoint(i, hashes.len())) {
        let guesses = idx.assumed.get(&hashes[i]).map_or(&[][..], Vec::as_slice);
        let newest = guesses
            .iter()
            .max_by_key(|g| g.expires_ms)
            .map(|g| g.replica);
        let guessed = guesses.iter().any(|g| {
            g.replica == replica && g.expires_ms > now && (!only_latest || newest == Some(replica))
        });
        if !guessed && blocks <= i {
            break;
        }
        if guessed {
            best = f64::max(best, value + (i + 1 - blocks.min(i + 1)) as f64);
        }
    }
    best
}

use proptest::strategy::Strategy;

proptest::proptest! {
    /// The walk over all replicas at once finds what each replica's own walk finds.
    #[test]
    fn overlaps_are_each_replicas_worth(
        held in proptest::collection::vec(
            (
                proptest::collection::vec(0u64..6, 0..10),
                proptest::collection::vec(0u64..6, 0..4),
                proptest::collection::vec(0u64..6, 0..4),
            ),
            4,
        ),
        order in proptest::strategy::Just((0..4).collect::<Vec<usize>>()).prop_shuffle(),
        values in proptest::collection::vec((proptest::option::of(0.0f64..1.0), proptest::option::of(0.0f64..1.0)), 4),
        guesses in proptest::collection::vec(
            (0u32..4, proptest::collection::vec(0u64..6, 0..12), 0usize..4, 0u64..100),
            0..12,
        ),
        query in proptest::collection::vec(0u64..6, 0..12),
        now in 0u64..150,
    ) {
        let mut idx = PreciseIndex::default();
        for (r, &(host, disk)) in values.iter().enumerate() {
            idx.set_tier_values(ReplicaId(r as u32), TierValues { host, disk });
        }
        for r in order {
            let (device, host, disk) = &held[r];
            let mut update = snapshot(0, device);
            if let Some(s) = update.snapshot.as_mut() {
                s.host_hashes = host.clone();
                s.disk_hashes = disk.clone();
            }
            idx.apply(ReplicaId(r as u32), &update);
        }
        for (r, hashes, held, at) in &guesses {
            idx.assume(ReplicaId(*r), hashes, *held, *at, at + 50);
        }
        let (mut m, mut latest) = (vec![0.0; 4], vec![0.0; 4]);
        idx.overlaps_and_latest(&query, now, &mut m, &mut latest);
        for r in 0..4 {
            let replica = ReplicaId(r as u32);
            // Counted by tier, not summed block by block: alike up to rounding.
            let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b.abs().max(1.0);
            let (all, only_latest) = (
                worth_by_definition(&idx, &query, now, false, replica),
                worth_by_definition(&idx, &query, now, true, replica),
            );
            proptest::prop_assert!(close(m[r], all), "{} against {all}", m[r]);
            proptest::prop_assert!(close(latest[r], only_latest), "{} against {only_latest}", latest[r]);
        }
    }
}

#[test]
fn a_guess_whose_block_events_remove_later_counts_only_as_a_guess() {
    let mut idx = PreciseIndex::default();
    let prompt: Vec<u64> = (1..=8).collect();
    idx.apply(A, &snapshot(0, &[]));
    idx.apply(B, &snapshot(0, &[]));
    idx.assume(A, &prompt, 0, 100, 3_000);
    idx.assume(B, &prompt, 0, 100, 3_000);
    let evicted = |seq| KvEventBatch {
        version: KV_EVENTS_VERSION,
        seq,
        events: vec![KvEvent::Removed {
            hashes: vec![8],
            tier: Tier::Device,
        }],
    };
    idx.apply(
        A,
        &batches(vec![stored(1, &prompt, Tier::Device), evicted(2)]),
    );
    let unevicted = |idx: &PreciseIndex| {
        let mut m = vec![0.0; 2];
        idx.overlaps_unevicted(&prompt, 200, &mut m);
        m
    };
    // The guess stands through the eviction; only the unevicted view drops its second stride.
    assert_eq!(overlaps(&idx, &prompt, 200), vec![8.0, 8.0]);
    assert_eq!(unevicted(&idx), vec![7.0, 8.0]);
    // A decision made after the eviction guesses afresh: the prompt is computed there again.
    idx.assume(A, &prompt, 7, 300, 3_300);
    assert_eq!(unevicted(&idx), vec![8.0, 8.0]);
}
