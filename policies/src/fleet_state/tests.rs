//! The fleet state's events: requests in flight and their prefill, reports and their ages,
//! membership, and which replicas may serve a request.

use super::*;
use kvgate_protocol::kv_events::{KvSnapshot, KV_EVENTS_VERSION};
use kvgate_protocol::telemetry::{EngineLoad, KvUpdate};

fn spec(name: &str, models: &[&str]) -> ReplicaSpec {
    ReplicaSpec {
        name: name.into(),
        url: format!("http://{name}"),
        models: models.iter().map(|m| m.to_string()).collect(),
        labels: BTreeMap::new(),
        max_in_flight: None,
    }
}

const AGES: ReportAges = ReportAges {
    stale_after_ms: 1_000,
    exclude_after_ms: 5_000,
};

fn fleet(n: u32) -> FleetState {
    let mut f = FleetState::new(PolicyConfig::default(), Some(AGES));
    f.set_replicas(
        (0..n)
            .map(|i| (ReplicaId(i), spec(&format!("r{i}"), &["m"])))
            .collect(),
    );
    f
}

fn features(tokens: u64) -> RequestFeatures {
    RequestFeatures {
        prefix_chunks: vec![1, 2, 3],
        prompt_tokens: tokens,
        ring_key: 42,
        ..Default::default()
    }
}

fn ask<'a>(model: &'a str, f: &'a RequestFeatures) -> Ask<'a> {
    static ANY: BTreeMap<String, String> = BTreeMap::new();
    Ask {
        model,
        pool: &ANY,
        features: f,
    }
}

fn report(instance: u64, seq: u64, load: EngineLoad) -> TelemetryReport {
    TelemetryReport {
        instance,
        seq,
        healthy: true,
        load,
        ..Default::default()
    }
}

#[test]
fn a_request_counts_in_flight_until_it_ends_and_its_prompt_until_its_first_token() {
    let mut f = fleet(2);
    let feats = features(1_000);
    let d = f.route(7, &ask("m", &feats), 0, 3).unwrap();
    let to = d.ranked[0].replica;
    let r = f.replica(to).unwrap();
    assert_eq!((r.in_flight, r.prefill_backlog()), (1, 1_000));
    assert_eq!(r.last_decision, Some(d.ranked[0]));
    f.first_token(7, 5);
    let r = f.replica(to).unwrap();
    assert_eq!((r.in_flight, r.prefill_backlog()), (1, 0));
    f.finished(7);
    f.finished(7);
    let r = f.replica(to).unwrap();
    assert_eq!((r.in_flight, r.prefill_backlog()), (0, 0));
    assert_eq!(f.requests_in_flight(), 0);
}

#[test]
fn a_retry_moves_the_request_to_its_next_replica() {
    let mut f = fleet(2);
    let feats = features(500);
    let d = f.route(1, &ask("m", &feats), 0, 3).unwrap();
    let (first, next) = (d.ranked[0], d.ranked[1]);
    f.send(1, &next, &feats, 0);
    assert_eq!(f.replica(first.replica).unwrap().in_flight, 0);
    assert_eq!(f.replica(first.replica).unwrap().prefill_backlog(), 0);
    assert_eq!(f.replica(next.replica).unwrap().in_flight, 1);
    f.finished(1);
    assert_eq!(f.replica(next.replica).unwrap().in_flight, 0);
}

#[test]
fn a_replica_nearly_through_its_one_prompt_draws_a_cold_one_before_a_slower_one() {
    let prompt = |key: u64, now_ms: u64| RequestFeatures {
        ring_key: key,
        prefix_chunks: vec![key],
        now_ms,
        ..features(1_000)
    };
    let mut f = fleet(2);
    let next = prompt(99, 69);
    // Against the ring's order, which breaks the tie without the pace.
    let ring_first = f.rank(&ask("m", &next), 0, 2).unwrap().ranked[0].replica;
    let (fast, slow) = if ring_first == ReplicaId(0) {
        (ReplicaId(1), ReplicaId(0))
    } else {
        (ReplicaId(0), ReplicaId(1))
    };
    let send_to = |f: &mut FleetState, id: RequestId, to: ReplicaId, p: &RequestFeatures| {
        let d = f.rank(&ask("m", p), p.now_ms, 2).unwrap();
        let choice = d.ranked.iter().find(|c| c.replica == to).unwrap();
        f.send(id, choice, p, p.now_ms);
    };
    // One learns a pace of 100 tokens a millisecond, the other of 20.
    send_to(&mut f, 1, fast, &prompt(1, 0));
    send_to(&mut f, 2, slow, &prompt(2, 0));
    f.first_token(1, 10);
    f.first_token(2, 50);
    // One prompt each, sent together: 900 tokens through on one by 69 ms, 180 on the other.
    send_to(&mut f, 3, fast, &prompt(3, 60));
    send_to(&mut f, 4, slow, &prompt(4, 60));
    let d = f.rank(&ask("m", &next), 69, 2).unwrap();
    assert_eq!(d.ranked[0].replica, fast, "{d:?}");
    assert_eq!(d.ranked[0].prefill_backlog, 1_000 - 900);
}

#[test]
fn a_retried_prompt_counts_as_started_when_resent_not_when_it_arrived() {
    let mut f = fleet(2);
    let at = |now_ms: u64| RequestFeatures {
        now_ms,
        ..features(1_000)
    };
    // Both replicas learn 100 tokens a millisecond.
    for (id, to) in [(1, 0), (2, 1)] {
        let d = f.rank(&ask("m", &at(0)), 0, 2).unwrap();
        let choice = d
            .ranked
            .iter()
            .find(|c| c.replica == ReplicaId(to))
            .unwrap();
        f.send(id, choice, &at(0), 0);
        f.first_token(id, 10);
    }
    // A prompt neither holds arrived at 20, failed on its first replica, resent at 500.
    let arrived = RequestFeatures {
        prefix_chunks: vec![7, 8, 9],
        ring_key: 7,
        ..at(20)
    };
    let d = f.route(3, &ask("m", &arrived), 20, 2).unwrap();
    let next = d.ranked[1];
    f.send(3, &next, &arrived, 500);
    let d = f.rank(&ask("m", &at(505)), 505, 2).unwrap();
    let there = d.ranked.iter().find(|c| c.replica == next.replica).unwrap();
    // 5 ms at 100 a millisecond: half its prompt, not all of it.
    assert_eq!(there.prefill_backlog, next.prefill_tokens - 500, "{d:?}");
}

#[test]
fn a_recurring_prompt_is_copied_without_penalty_where_nothing_waits_and_empty_blocks_take_it() {
    // A 2,048-token system prompt (128 blocks of 16) and a 512-token question of each
    // request's own: r0 holds the system prompt by its KV events, r1 holds nothing.
    let (holder, idle) = (ReplicaId(0), ReplicaId(1));
    let system: Vec<u64> = (1..=128).collect();
    let prompt = |request: u64| RequestFeatures {
        block_hashes: system
            .iter()
            .copied()
            .chain((0..32).map(|i| 1_000 * (request + 1) + i))
            .collect(),
        prompt_tokens: 2_560,
        ring_key: 42,
        ..Default::default()
    };
    let first_for = |idle_blocks: u64, idle_cached: u64| {
        let mut f = fleet(2);
        let other: Vec<u64> = (0..idle_cached).map(|i| 50_000 + i).collect();
        for (id, total, cached) in [
            (holder, 10_000, &system[..]),
            (idle, idle_blocks, &other[..]),
        ] {
            let load = EngineLoad {
                kv_blocks_total: total,
                block_size: 16,
                ..Default::default()
            };
            f.report(id, &report(1, 1, load), 0);
            let snapshot = KvSnapshot {
                version: KV_EVENTS_VERSION,
                seq: 0,
                block_size: 16,
                hashes: cached.to_vec(),
                host_hashes: vec![],
                disk_hashes: vec![],
            };
            f.kv_events(
                id,
                &KvUpdate {
                    snapshot: Some(snapshot),
                    batches: vec![],
                },
            );
        }
        // A request of another group done on the holder, so that this group is not all the
        // traffic (which would make it hot at once); then five questions queued on the
        // holder: 2,560 tokens ahead there.
        let other_group = RequestFeatures {
            block_hashes: (900_000..900_004).collect(),
            prompt_tokens: 64,
            ring_key: 7,
            ..Default::default()
        };
        let d = f.rank(&ask("m", &other_group), 0, 2).unwrap();
        let to_holder = d.ranked.iter().find(|c| c.replica == holder).unwrap();
        f.send(99, to_holder, &other_group, 0);
        f.finished(99);
        for request in 0..5 {
            let p = prompt(request);
            let d = f.rank(&ask("m", &p), 0, 2).unwrap();
            let to_holder = d.ranked.iter().find(|c| c.replica == holder).unwrap();
            f.send(request, to_holder, &p, 0);
        }
        f.rank(&ask("m", &prompt(5)), 0, 2).unwrap().ranked[0].replica
    };
    // Room for the whole prompt: the copy delays no one and evicts nothing.
    assert_eq!(first_for(160, 0), idle);
    assert_eq!(first_for(200, 40), idle);
    // One block short, or the room taken by another prompt's blocks: the copy would evict,
    // and the recompute penalty keeps the holder.
    assert_eq!(first_for(159, 0), holder);
    assert_eq!(first_for(200, 41), holder);
}

#[test]
fn concurrent_decisions_see_each_other() {
    let mut f = fleet(2);
    let (a, b) = (
        features(100),
        RequestFeatures {
            ring_key: 43,
            prefix_chunks: vec![9],
            ..features(100)
        },
    );
    let first = f.route(1, &ask("m", &a), 0, 1).unwrap().ranked[0].replica;
    let second = f.route(2, &ask("m", &b), 0, 1).unwrap().ranked[0];
    assert_eq!(second.in_flight, 0, "the idle one wins: {second:?}");
    assert_ne!(second.replica, first);
}

#[test]
fn reports_age_into_stale_and_excluded_and_a_restart_forgets_the_cache() {
    let mut f = fleet(1);
    let id = ReplicaId(0);
    assert_eq!(
        f.replica(id).unwrap().freshness(f.report_ages(), 0),
        Freshness::NoAgent
    );
    let load = EngineLoad {
        waiting: 3,
        kv_blocks_total: 10,
        kv_blocks_used: 5,
        ..Default::default()
    };
    let out = f.report(id, &report(1, 1, load.clone()), 100).unwrap();
    assert_eq!(
        out,
        ReportOutcome {
            restarted: false,
            missed: 0
        }
    );
    let r = f.replica(id).unwrap();
    assert_eq!(r.reported_waiting(), 3);
    assert_eq!(r.reported_kv_usage(), Some(0.5));
    let ages = f.report_ages();
    assert_eq!(r.freshness(ages, 1_099), Freshness::Fresh);
    assert_eq!(r.freshness(ages, 1_100), Freshness::Stale);
    assert!(r.is_routable(ages, 5_099));
    assert_eq!(r.freshness(ages, 5_100), Freshness::Excluded);
    assert!(!r.is_routable(ages, 5_100));

    // Three reports lost, then one from a new worker process.
    let feats = features(10);
    f.route(1, &ask("m", &feats), 200, 1).unwrap();
    assert!(!f
        .policy()
        .prefix_index()
        .overlaps(&feats.prefix_chunks)
        .is_empty());
    let out = f.report(id, &report(1, 5, load.clone()), 300).unwrap();
    assert_eq!(
        out,
        ReportOutcome {
            restarted: false,
            missed: 3
        }
    );
    let out = f.report(id, &report(2, 1, load), 400).unwrap();
    assert!(out.restarted);
    assert!(f
        .policy()
        .prefix_index()
        .overlaps(&feats.prefix_chunks)
        .is_empty());
    assert_eq!(f.replica(id).unwrap().agent.as_ref().unwrap().missed, 3);
}

const EJECT: Ejection = Ejection {
    after_failures: 2,
    base_ms: 100,
    max_ms: 150,
};

#[test]
fn ejects_after_consecutive_failures_with_doubling_backoff() {
    let mut f = fleet(1);
    let id = ReplicaId(0);
    assert_eq!(f.failed(id, 0, EJECT), FailureOutcome::Counted);
    f.succeeded(id);
    assert_eq!(f.failed(id, 0, EJECT), FailureOutcome::Counted);
    assert_eq!(f.failed(id, 0, EJECT), FailureOutcome::Ejected(100));
    assert!(!f.replica(id).unwrap().is_routable(None, 99));
    // The back-off is over, the check still failing.
    assert_eq!(f.checked(id, false, 100, EJECT), FailureOutcome::Counted);
    assert_eq!(
        f.checked(id, false, 100, EJECT),
        FailureOutcome::Ejected(150)
    );
    f.checked(id, true, 250, EJECT);
    assert!(f.replica(id).unwrap().is_routable(None, 250));
}

#[test]
fn passing_health_checks_do_not_end_the_back_off_of_failing_requests() {
    let mut f = fleet(1);
    let id = ReplicaId(0);
    let eject = Ejection {
        max_ms: 10_000,
        ..EJECT
    };
    let mut now = 0;
    // Every request fails while /health keeps answering: each ejection lasts twice the one
    // before.
    for expected in [100, 200, 400, 800] {
        assert_eq!(f.failed(id, now, eject), FailureOutcome::Counted);
        f.checked(id, true, now, eject);
        assert_eq!(f.failed(id, now, eject), FailureOutcome::Ejected(expected));
        now += expected;
        f.checked(id, true, now, eject);
        assert!(f.replica(id).unwrap().is_routable(None, now));
    }
    // A request that succeeds starts the back-off over.
    f.succeeded(id);
    f.failed(id, now, eject);
    assert_eq!(f.failed(id, now, eject), FailureOutcome::Ejected(100));
}

#[test]
fn ejected_or_unhealthy_replicas_are_not_ranked() {
    let mut f = fleet(2);
    let feats = features(10);
    let once = Ejection {
        after_failures: 1,
        base_ms: 1_000,
        max_ms: 1_000,
    };
    f.failed(ReplicaId(0), 0, once);
    f.checked(ReplicaId(0), true, 0, once);
    f.checked(
        ReplicaId(1),
        false,
        0,
        Ejection {
            after_failures: 9,
            ..once
        },
    );
    assert_eq!(
        f.rank(&ask("m", &feats), 999, 3),
        Err(NoRoute::NoneHealthy { model: "m".into() })
    );
    let d = f.rank(&ask("m", &feats), 1_000, 3).unwrap();
    assert_eq!(d.ranked.len(), 1);
    assert_eq!(d.ranked[0].replica, ReplicaId(0));
}

#[test]
fn listed_models_then_unknown_ones_then_pools_decide_who_serves() {
    let mut f = FleetState::new(PolicyConfig::default(), None);
    let mut gpu = spec("b", &[]);
    gpu.labels.insert("tier".into(), "gpu".into());
    f.set_replicas(vec![(ReplicaId(0), spec("a", &["m"])), (ReplicaId(1), gpu)]);
    let feats = features(10);
    let ids = |d: Decision| d.ranked.iter().map(|c| c.replica.0).collect::<Vec<_>>();
    assert_eq!(ids(f.rank(&ask("m", &feats), 0, 9).unwrap()), vec![0]);
    // Nobody lists `x`: the replica whose models are unknown may serve it.
    assert_eq!(ids(f.rank(&ask("x", &feats), 0, 9).unwrap()), vec![1]);
    f.set_discovered_models(ReplicaId(1), vec!["y".into()]);
    assert_eq!(
        f.rank(&ask("x", &feats), 0, 9),
        Err(NoRoute::UnknownModel { model: "x".into() })
    );
    let pool: BTreeMap<String, String> = [("tier".to_string(), "gpu".to_string())].into();
    let in_pool = Ask {
        pool: &pool,
        ..ask("m", &feats)
    };
    assert!(matches!(
        f.rank(&in_pool, 0, 9),
        Err(NoRoute::NotInPool { .. })
    ));
    assert!(
        f.has_room(&in_pool, 0),
        "nobody serves it: routing says why"
    );
}

#[test]
fn an_adapter_goes_where_it_is_resident_or_a_slot_is_free() {
    let mut f = FleetState::new(PolicyConfig::default(), Some(AGES));
    f.set_replicas(
        (0..3)
            .map(|i| (ReplicaId(i), spec(&format!("r{i}"), &["base"])))
            .collect(),
    );
    let with = |adapters: &[&str], free: u32| EngineLoad {
        adapters: adapters.iter().map(|a| a.to_string()).collect(),
        adapter_slots_free: Some(free),
        ..Default::default()
    };
    f.report(ReplicaId(0), &report(1, 1, with(&["sql"], 0)), 0);
    f.report(ReplicaId(1), &report(1, 1, with(&[], 1)), 0);
    f.report(ReplicaId(2), &report(1, 1, with(&["other"], 0)), 0);
    let feats = features(10);
    let d = f.rank(&ask("sql", &feats), 0, 9).unwrap();
    let fit: BTreeMap<u32, f64> = d
        .ranked
        .iter()
        .map(|c| (c.replica.0, c.signals[crate::Signal::Adapter]))
        .collect();
    assert_eq!(fit, [(0, 1.0), (1, 0.5), (2, 0.0)].into());
}

#[test]
fn room_ends_at_a_cap_or_a_reported_saturation() {
    let mut f = FleetState::new(PolicyConfig::default(), Some(AGES));
    let mut capped = spec("a", &["m"]);
    capped.max_in_flight = Some(1);
    f.set_replicas(vec![(ReplicaId(0), capped)]);
    let feats = features(10);
    assert!(f.has_room(&ask("m", &feats), 0));
    f.route(1, &ask("m", &feats), 0, 1).unwrap();
    assert!(!f.has_room(&ask("m", &feats), 0));
    f.finished(1);
    let full = EngineLoad {
        kv_blocks_total: 10,
        kv_blocks_used: 10,
        ..Default::default()
    };
    f.report(ReplicaId(0), &report(1, 1, full), 0);
    assert!(!f.has_room(&ask("m", &feats), 0));
}

#[test]
fn membership_keeps_state_while_a_replica_stays_the_same() {
    let mut f = fleet(2);
    let feats = features(100);
    let to = f.route(1, &ask("m", &feats), 0, 1).unwrap().ranked[0].replica;
    f.checked(to, false, 0, EJECT);
    let specs = |f: &FleetState| -> Vec<(ReplicaId, ReplicaSpec)> {
        f.replicas().map(|(id, r)| (id, r.spec.clone())).collect()
    };
    let same = specs(&f);
    f.set_replicas(same.clone());
    assert!(
        !f.replica(to).unwrap().healthy,
        "unchanged: its state stays"
    );
    // Its URL changed: it starts over, but the request still in flight on it counts.
    let moved: Vec<_> = same
        .into_iter()
        .map(|(id, mut s)| {
            if id == to {
                s.url = "http://elsewhere".into();
            }
            (id, s)
        })
        .collect();
    f.set_replicas(moved);
    let r = f.replica(to).unwrap();
    assert!(r.healthy);
    assert_eq!(r.in_flight, 1);
    f.finished(1);
    assert_eq!(f.replica(to).unwrap().in_flight, 0);
    // Gone from the list: gone, and a request ending there later changes nothing.
    f.route(2, &ask("m", &feats), 0, 1).unwrap();
    f.set_replicas(vec![]);
    f.finished(2);
    assert_eq!(f.replicas().count(), 0);
}

#[test]
fn peers_backlogs_count_beside_this_gateways_own_until_they_lapse() {
    let mut f = fleet(2);
    let feats = features(1_000);
    let first = f.rank(&ask("m", &feats), 0, 2).unwrap().ranked[0].replica;
    let other = ReplicaId(1 - first.0);
    f.peer_backlog(7, vec![(first, 20_000)], 100);
    let d = f.rank(&ask("m", &feats), 50, 2).unwrap();
    assert_eq!(d.ranked[0].replica, other, "{d:?}");
    assert_eq!(d.ranked[1].prefill_backlog, 20_000);
    // Two peers add up; a peer's next word replaces its last.
    f.peer_backlog(8, vec![(other, 15_000)], 100);
    f.peer_backlog(7, vec![(first, 10_000)], 100);
    let d = f.rank(&ask("m", &feats), 50, 2).unwrap();
    assert_eq!(d.ranked[0].replica, first, "{d:?}");
    // This gateway's own backlog is what it tells its peers; theirs is not in it.
    let sent = f.route(1, &ask("m", &feats), 50, 2).unwrap().ranked[0];
    assert_eq!(f.backlogs(), [(sent.replica, 1_000)]);
    // Lapsed: only this gateway's own request counts.
    let d = f.rank(&ask("m", &feats), 100, 2).unwrap();
    let backlog = |d: &Decision, r: ReplicaId| {
        d.ranked
            .iter()
            .find(|c| c.replica == r)
            .unwrap()
            .prefill_backlog
    };
    let unsent = ReplicaId(1 - sent.replica.0);
    assert_eq!((backlog(&d, sent.replica), backlog(&d, unsent)), (1_000, 0));
    // New membership: what peers said of the old slots is void.
    f.peer_backlog(7, vec![(other, 50_000)], 1_000);
    f.set_replicas(vec![
        (ReplicaId(0), spec("r0", &["m"])),
        (ReplicaId(1), spec("r1", &["m"])),
    ]);
    let d = f.rank(&ask("m", &feats), 200, 2).unwrap();
    assert_eq!((backlog(&d, sent.replica), backlog(&d, unsent)), (1_000, 0));
}

#[test]
fn the_tokens_streaming_back_time_a_replicas_steps_at_its_prefill_pace_while_it_serves() {
    let mut f = fleet(2);
    let first = features(1_000);
    let d = f.rank(&ask("m", &first), 0, 2).unwrap();
    let choice = d.ranked[0];
    let r = choice.replica;
    f.send(1, &choice, &first, 0);
    // 1,000 tokens to the first token in 10 ms: 100 a millisecond.
    f.first_token(1, 10);
    f.token(1, 10_000, None);
    // The proxy's path: the replica's clock, without the fleet's lock.
    f.step_clock(r).unwrap().token(15_000, Some(10_000));
    let wait_at = |f: &FleetState, now_us: u64| {
        let next = RequestFeatures {
            now_us,
            now_ms: now_us / 1_000,
            ..features(64)
        };
        let d = f.rank(&ask("m", &next), now_us / 1_000, 2).unwrap();
        d.ranked.iter().find(|c| c.replica == r).unwrap().step_wait
    };
    // Steps of 5 ms, the last ending at 15 ms: 4 ms left at 16 ms, 400 tokens' worth.
    assert_eq!(wait_at(&f, 16_000), 400);
    // Unknown without a clock of microseconds.
    assert_eq!(wait_at(&f, 0), 0);
    // With nothing in flight from here, the replica is likely idle: a request starts a step.
    f.finished(1);
    assert_eq!(wait_at(&f, 16_000), 0);
}

#[test]
fn the_gateways_counted_are_the_most_any_agent_reports_to_and_at_least_the_peers() {
    let mut f = fleet(3);
    let says = |n: Option<u32>, seq| TelemetryReport {
        gateways: n,
        ..report(1, seq, EngineLoad::default())
    };
    assert_eq!((f.gateways(), f.gateways_seen()), (1, 1));
    f.report(ReplicaId(0), &says(Some(4), 1), 0);
    f.report(ReplicaId(1), &says(Some(8), 1), 0);
    f.report(ReplicaId(2), &says(None, 1), 0);
    assert_eq!(f.gateways(), 8);
    // The agent that said the most says fewer: the most is found again over every agent.
    f.report(ReplicaId(1), &says(Some(2), 2), 0);
    assert_eq!(f.gateways(), 4);
    // A report out of bounds counts as the most there may be.
    f.report(ReplicaId(2), &says(Some(u32::MAX), 2), 0);
    assert_eq!(f.gateways(), MAX_GATEWAYS);
    // Its replica leaves the fleet.
    f.set_replicas(vec![
        (ReplicaId(0), spec("r0", &["m"])),
        (ReplicaId(1), spec("r1", &["m"])),
    ]);
    assert_eq!(f.gateways(), 4);
    // Peers that share their decisions are counted, and seen.
    f.set_peer_group(6);
    assert_eq!((f.gateways(), f.gateways_seen()), (6, 6));
    f.report(ReplicaId(0), &says(None, 2), 0);
    f.report(ReplicaId(1), &says(None, 3), 0);
    f.set_peer_group(1);
    assert_eq!((f.gateways(), f.gateways_seen()), (1, 1));
}
