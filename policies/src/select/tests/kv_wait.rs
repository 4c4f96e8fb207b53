//! A replica whose engine queues requests for want of KV room starts this one only as its
//! running requests end: the wait counts in the prefill signal, in place of the prompts queued
//! where it is longer.

use super::*;
use crate::{Ask, FleetState, ReplicaSpec};
use kvgate_protocol::telemetry::{EngineLoad, TelemetryReport};
use std::collections::BTreeMap;

/// A prompt of 17 blocks of 100 tokens, the first 16 a system prompt every request shares.
fn prompt(now_ms: u64) -> RequestFeatures {
    RequestFeatures {
        prompt_tokens: 1_700,
        block_hashes: (0..17)
            .map(|b| if b < 16 { b } else { 1 << 40 | now_ms })
            .collect(),
        ring_key: 7,
        now_ms,
        ..Default::default()
    }
}

/// Three replicas of 10,000 tokens of KV, half in use but the first's `usage`; the first's
/// engine queues `waiting` requests and frees a running one's KV every `admit_interval`.
fn fleet(usage: f64, waiting: u32, admit_interval: u64) -> Vec<ReplicaView> {
    let mut fleet = view(&[4, 4, 4]);
    for r in &mut fleet {
        r.kv_usage = Some(0.5);
        r.kv_capacity_tokens = Some(10_000);
    }
    fleet[0].kv_usage = Some(usage);
    fleet[0].waiting = waiting;
    fleet[0].kv_queue = waiting;
    fleet[0].admit_interval = admit_interval;
    fleet
}

/// Where the next prompt goes with the system prompt sent to replica 0 before, and replica 0's
/// candidate.
fn next_prompt(usage: f64, waiting: u32, admit_interval: u64) -> (ReplicaId, Candidate) {
    let mut p = policy_with(3, PolicyConfig::default());
    p.record(ReplicaId(0), &prompt(0));
    let d = p.select(
        &prompt(10),
        FleetView {
            replicas: &fleet(usage, waiting, admit_interval),
        },
    );
    let home = d.ranked.iter().find(|c| c.replica == ReplicaId(0)).copied();
    (d.ranked[0].replica, home.unwrap_or_else(|| d.ranked[0]))
}

#[test]
fn a_prompt_queued_for_kv_room_behind_long_streams_goes_where_it_starts_at_once() {
    // 100 tokens free, 100 to compute: one of the 10 queued starts at once, the other 9 and
    // this one each wait a running request's end, 1,000 tokens' worth: 10,000 against a whole
    // prompt's prefill and its recompute elsewhere.
    let (to, home) = next_prompt(0.99, 10, 1_000);
    assert_eq!(home.prefix_blocks, 16.0);
    assert_eq!(home.kv_wait, 10_000);
    assert!(home.breakdown().contains(";kv_wait=10000"));
    assert_ne!(to, ReplicaId(0));
}

#[test]
fn the_holder_keeps_the_prompt_where_its_queue_finds_room_or_ends_soon_or_is_empty() {
    // Room for all the queue: nothing to wait for.
    let (to, home) = next_prompt(0.5, 10, 1_000);
    assert_eq!((to, home.kv_wait), (ReplicaId(0), 0));
    // Its running requests end often: 1,000 tokens' wait, less than a recompute elsewhere.
    let (to, home) = next_prompt(0.99, 10, 100);
    assert_eq!((to, home.kv_wait), (ReplicaId(0), 1_000));
    // Room for 3 of the 11 at once (300 tokens free): 8 waits.
    let (to, home) = next_prompt(0.97, 10, 100);
    assert_eq!((to, home.kv_wait), (ReplicaId(0), 800));
    // Nothing queued: an engine prefilling in chunks starts it in the room it has.
    assert_eq!(next_prompt(0.995, 0, 10_000).0, ReplicaId(0));
    // How long its streams run is not known yet.
    assert_eq!(next_prompt(0.99, 10, 0).0, ReplicaId(0));
}

#[test]
fn no_wait_for_kv_room_counts_where_every_engine_queues() {
    let mut p = policy_with(3, PolicyConfig::default());
    p.record(ReplicaId(0), &prompt(0));
    let mut replicas = fleet(0.99, 10, 1_000);
    for r in &mut replicas[1..] {
        r.kv_queue = 1;
    }
    let d = p.select(
        &prompt(10),
        FleetView {
            replicas: &replicas,
        },
    );
    assert_eq!(d.ranked[0].replica, ReplicaId(0));
    assert_eq!(d.ranked[0].kv_wait, 0);
    // One replica without a queue: the fleet is not short of KV everywhere.
    replicas[2].kv_queue = 0;
    let d = p.select(
        &prompt(10),
        FleetView {
            replicas: &replicas,
        },
    );
    assert_ne!(d.ranked[0].replica, ReplicaId(0));
}

/// A fleet of two replicas serving model `m`.
fn two_replicas() -> FleetState {
    let mut f = FleetState::new(PolicyConfig::default(), None);
    let spec = |name: &str| ReplicaSpec {
        name: name.into(),
        url: format!("http://{name}"),
        models: vec!["m".into()],
        labels: BTreeMap::new(),
        max_in_flight: None,
    };
    f.set_replicas(vec![(ReplicaId(0), spec("r0")), (ReplicaId(1), spec("r1"))]);
    f
}

/// Replica 0's agent reports `running` and `waiting` requests, its KV blocks all in use with
/// `kv_full`, at 0 ms.
fn report(f: &mut FleetState, seq: u64, running: u32, waiting: u32, kv_full: bool) {
    let blocks = if kv_full { 100 } else { 0 };
    let report = TelemetryReport {
        healthy: true,
        seq,
        load: EngineLoad {
            running,
            waiting,
            kv_blocks_total: blocks,
            kv_blocks_used: blocks,
            block_size: 16,
            ..Default::default()
        },
        ..Default::default()
    };
    f.report(ReplicaId(0), &report, 0);
}

/// Replica 0's candidate for a prompt of 1,000 tokens at `now_ms`.
fn replica_0(f: &FleetState, now_ms: u64) -> Option<Candidate> {
    static ANY: BTreeMap<String, String> = BTreeMap::new();
    let features = RequestFeatures {
        prompt_tokens: 1_000,
        now_ms,
        ..Default::default()
    };
    let ask = Ask {
        model: "m",
        pool: &ANY,
        features: &features,
    };
    let d = f.rank(&ask, now_ms, 2).ok()?;
    d.ranked.into_iter().find(|c| c.replica == ReplicaId(0))
}

#[test]
fn a_replicas_admit_interval_is_its_streams_length_over_its_running_requests_at_its_pace() {
    let mut f = two_replicas();
    let interval = |f: &FleetState| f.replica(ReplicaId(0)).map(|r| r.admit_interval());
    assert_eq!(interval(&f), Some(0));
    // 1,000 tokens to the first token in 10 ms: 100 a millisecond.
    let Some(r0) = replica_0(&f, 0) else {
        panic!("replica 0 not ranked");
    };
    f.send(1, &r0, &RequestFeatures::default(), 0);
    f.first_token(1, 10);
    report(&mut f, 1, 4, 0, false);
    // No stream has ended yet.
    assert_eq!(interval(&f), Some(0));
    // A stream of 80 ms over 4 running: one ends every 20 ms, 2,000 tokens' worth.
    f.streamed(1, 10_000, 90_000);
    f.finished(1);
    assert_eq!(interval(&f), Some(2_000));
    report(&mut f, 2, 8, 0, false);
    assert_eq!(interval(&f), Some(1_000));
    // None running: nothing to wait for.
    report(&mut f, 3, 0, 0, false);
    assert_eq!(interval(&f), Some(0));
    // A stream of a request not in flight here teaches nothing.
    report(&mut f, 4, 8, 0, false);
    f.streamed(2, 0, 1_000_000);
    assert_eq!(interval(&f), Some(1_000));
    // Five queued at the report (at 0 ms) with every KV block in use, one starting every
    // 10 ms since, 1,000 tokens' worth.
    report(&mut f, 5, 8, 5, true);
    let queued = |now_ms| f.replica(ReplicaId(0)).map(|r| r.queued_now(now_ms));
    assert_eq!(queued(0), Some(5));
    assert_eq!(queued(25), Some(3));
    assert_eq!(queued(500), Some(0));
    // The decision counts the queue as it likely is: those still queued, then this one.
    let kv_wait_at = |now_ms| replica_0(&f, now_ms).map(|c| c.kv_wait);
    assert_eq!(kv_wait_at(0), Some(6_000));
    assert_eq!(kv_wait_at(25), Some(4_000));
    assert_eq!(kv_wait_at(500), Some(0));
}

#[test]
fn a_queue_reported_counts_whole_while_the_admit_interval_is_unknown() {
    let mut f = two_replicas();
    assert_eq!(f.replica(ReplicaId(0)).map(|r| r.queued_now(0)), Some(0));
    report(&mut f, 1, 8, 5, false);
    assert_eq!(
        f.replica(ReplicaId(0)).map(|r| r.queued_now(10_000)),
        Some(5)
    );
}

#[test]
fn the_explained_wait_is_the_one_counted_for_a_hot_group_copied_where_nothing_is_queued() {
    // A hot group held by three of four replicas: on the fourth, with no prompt queued, its
    // shared blocks count as held, so only the rest of the prompt waits for KV room (100
    // tokens free, 2 requests queued, one running request's end every 1,000 tokens).
    let f = RequestFeatures {
        prompt_tokens: 1_000,
        ..features(7, &[1, 2, 3, 4, 5, 6, 7, 8])
    };
    let (p, mut fleet) = hot_on_three_of_four(&f);
    let idle = &mut fleet[3];
    idle.kv_capacity_tokens = Some(10_000);
    idle.kv_usage = Some(0.99);
    idle.kv_queue = 2;
    idle.admit_interval = 1_000;
    let d = p.select(&f, FleetView { replicas: &fleet });
    assert!(d.hot_group);
    let copy = d.ranked.iter().find(|c| c.replica == ReplicaId(3)).unwrap();
    assert_eq!(copy.prefill_tokens, 1_000);
    assert_eq!(copy.kv_wait, 0, "{}", copy.breakdown());
}
