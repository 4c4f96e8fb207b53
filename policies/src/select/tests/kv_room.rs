//! A decision's guess that its events have since contradicted (an eviction) counts only for a
//! group that recurs, or where no replica has KV room for the rest of the prompt.

use super::*;
use kvgate_protocol::kv_events::{KvEvent, KvEventBatch, KvSnapshot, Tier, KV_EVENTS_VERSION};
use kvgate_protocol::telemetry::KvUpdate;

/// A prompt of `blocks` block hashes (100 tokens each), the first `shared` of them those of
/// the prompt sent first.
fn prompt(shared: u64, blocks: u64, now_ms: u64) -> RequestFeatures {
    RequestFeatures {
        prompt_tokens: blocks * 100,
        block_hashes: (0..blocks)
            .map(|b| if b < shared { b } else { 1 << 40 | b })
            .collect(),
        ring_key: 7,
        now_ms,
        ..Default::default()
    }
}

/// Three replicas reporting 10,000 tokens of KV, half of it in use, the first's `usage`, the
/// others' `others`.
fn fleet(usage: f64, others: f64) -> Vec<ReplicaView> {
    let mut fleet = view(&[1, 1, 1]);
    for r in &mut fleet {
        r.kv_usage = Some(others);
        r.kv_capacity_tokens = Some(10_000);
    }
    fleet[0].kv_usage = Some(usage);
    fleet
}

/// Replica 0's events: an empty cache, then `hashes` stored and, with `evicted`, removed.
fn events(p: &mut Policy, hashes: &[u64], evicted: bool) {
    let batch = |seq, event| KvEventBatch {
        version: KV_EVENTS_VERSION,
        seq,
        events: vec![event],
    };
    let mut batches = vec![batch(
        1,
        KvEvent::Stored {
            hashes: hashes.to_vec(),
            parent: None,
            tier: Tier::Device,
        },
    )];
    if evicted {
        batches.push(batch(
            2,
            KvEvent::Removed {
                hashes: hashes.to_vec(),
                tier: Tier::Device,
            },
        ));
    }
    let snapshot = KvSnapshot {
        version: KV_EVENTS_VERSION,
        seq: 0,
        block_size: 16,
        hashes: vec![],
        host_hashes: vec![],
        disk_hashes: vec![],
    };
    p.apply_kv(
        ReplicaId(0),
        &KvUpdate {
            snapshot: Some(snapshot),
            batches,
        },
    );
}

/// Where a prompt sharing the first 8 of its 16 blocks with `sent` earlier ones sent to
/// replica 0 goes, and what replica 0 is counted to hold of it: its events showed the shared
/// blocks stored and, with `evicted`, removed since; `usage` of its KV is in use, `others` of
/// the other two's, and `backlog` prompt tokens are queued on it.
fn second_prompt(
    sent: u64,
    evicted: bool,
    usage: f64,
    others: f64,
    backlog: u64,
) -> (ReplicaId, f64) {
    let mut p = policy_with(3, PolicyConfig::default());
    let first = prompt(16, 16, 0);
    for _ in 0..sent {
        p.record(ReplicaId(0), &first);
    }
    events(&mut p, &first.block_hashes[..8], evicted);
    let mut replicas = fleet(usage, others);
    replicas[0].prefill_backlog = backlog;
    let d = p.select(
        &prompt(8, 16, 10),
        FleetView {
            replicas: &replicas,
        },
    );
    let held = d
        .ranked
        .iter()
        .find(|c| c.replica == ReplicaId(0))
        .map_or(-1.0, |c| c.prefix_blocks);
    (d.ranked[0].replica, held)
}

#[test]
fn an_evicted_guess_does_not_count_for_a_group_that_does_not_recur() {
    // 800 tokens to compute, 5,000 or 1,000 free: the blocks are gone all the same.
    assert_eq!(second_prompt(1, true, 0.5, 0.5, 0).1, 0.0);
    assert_eq!(second_prompt(1, true, 0.9, 0.5, 0).1, 0.0);
    // 700 tokens free, 800 to compute: it would wait, then compute the evicted blocks again.
    let (to, held) = second_prompt(1, true, 0.93, 0.5, 0);
    assert_eq!(held, 0.0);
    assert_ne!(to, ReplicaId(0));
}

#[test]
fn an_evicted_guess_draws_no_request_behind_a_queue_where_the_cache_has_room() {
    // Counted as held, 800 tokens' recompute elsewhere would cost more than the 1,600 queued.
    let (to, held) = second_prompt(1, true, 0.5, 0.5, 1_600);
    assert_eq!(held, 0.0);
    assert_ne!(to, ReplicaId(0));
    // While its events still show the blocks, they are worth the wait.
    assert_eq!(
        second_prompt(1, false, 0.5, 0.5, 1_600),
        (ReplicaId(0), 8.0)
    );
}

#[test]
fn a_guess_counts_where_events_still_show_it_or_no_replica_has_room() {
    assert_eq!(second_prompt(1, false, 0.93, 0.5, 0), (ReplicaId(0), 8.0));
    // Nowhere can it start at once: the group stays where it is computed again.
    assert_eq!(second_prompt(1, true, 0.93, 0.9, 0), (ReplicaId(0), 8.0));
}

#[test]
fn an_evicted_guess_counts_for_a_group_that_recurs() {
    // Four recent requests on three replicas: copies are used again, so it stays.
    assert_eq!(second_prompt(4, true, 0.93, 0.5, 0), (ReplicaId(0), 8.0));
    assert_eq!(second_prompt(4, true, 0.5, 0.5, 0), (ReplicaId(0), 8.0));
}
