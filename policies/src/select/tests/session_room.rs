//! Sessions past their caches: a turn whose home's live histories outgrow its KV cache, and
//! which its events show computing again what it evicted, goes where it fits, else where the
//! overflow already is.

use super::*;
use kvgate_protocol::kv_events::{KvEvent, KvEventBatch, KvSnapshot, Tier, KV_EVENTS_VERSION};
use kvgate_protocol::telemetry::KvUpdate;

/// `replica`'s events: 300 blocks removed from its device, then stored there again.
fn recomputing(p: &mut Policy, replica: ReplicaId) {
    let blocks: Vec<u64> = (0..300).map(|i| 1 << 60 | i).collect();
    let batch = |seq, event| KvEventBatch {
        version: KV_EVENTS_VERSION,
        seq,
        events: vec![event],
    };
    let update = KvUpdate {
        snapshot: Some(KvSnapshot {
            version: KV_EVENTS_VERSION,
            seq: 0,
            block_size: 16,
            hashes: blocks.clone(),
            host_hashes: vec![],
            disk_hashes: vec![],
        }),
        batches: vec![
            batch(
                1,
                KvEvent::Removed {
                    hashes: blocks.clone(),
                    tier: Tier::Device,
                },
            ),
            batch(
                2,
                KvEvent::Stored {
                    hashes: blocks,
                    parent: None,
                    tier: Tier::Device,
                },
            ),
        ],
    };
    p.apply_kv(replica, &update);
}

/// Session `s`'s turn of `tokens` (token mode: one block hash per 100 tokens, each session's
/// own), at `now_ms`.
fn turn(s: u64, tokens: u64, now_ms: u64) -> RequestFeatures {
    RequestFeatures {
        session: Some(s),
        prompt_tokens: tokens,
        block_hashes: (0..tokens / 100).map(|b| s << 32 | b).collect(),
        ring_key: s,
        now_ms,
        ..Default::default()
    }
}

/// Two idle replicas whose agents report a cache of `caps` tokens each (`None`: no report).
fn fleet(caps: [Option<u64>; 2]) -> Vec<ReplicaView> {
    let mut fleet = view(&[0, 0]);
    for (r, cap) in fleet.iter_mut().zip(caps) {
        r.kv_capacity_tokens = cap;
    }
    fleet
}

/// A policy with session 1 (3,000 tokens) and `on_home` more tokens of other sessions on
/// replica 0, and `elsewhere` tokens of sessions on replica 1, all at time 0; replica 0's
/// events show it computing again what it evicted.
fn sessions(on_home: u64, elsewhere: u64) -> Policy {
    let mut p = policy_with(2, PolicyConfig::default());
    recomputing(&mut p, ReplicaId(0));
    p.record(ReplicaId(0), &turn(1, 3_000, 0));
    for (replica, tokens, s) in [(0, on_home, 2), (1, elsewhere, 3)] {
        if tokens > 0 {
            p.record(ReplicaId(replica), &turn(s, tokens, 0));
        }
    }
    p
}

#[test]
fn a_turn_past_its_homes_cache_goes_where_it_fits_or_where_the_overflow_is() {
    let cap = Some(10_000);
    // (tokens on the home beside session 1, on replica 1, session 1's next turn, where it goes)
    for (on_home, elsewhere, next, to) in [
        // 3,500 + 6,000 live on the home: within its 10,000.
        (6_000, 2_000, 3_500, 0),
        // 4,500 + 6,000: past it, and replica 1 has room for 4,500.
        (6_000, 2_000, 4_500, 1),
        // Past it, no room elsewhere, and the home is furthest past: it stays.
        (6_000, 9_800, 4_500, 0),
        // Past it, no room elsewhere, and replica 1 is further past: the overflow goes there.
        (6_000, 11_000, 4_500, 1),
    ] {
        let p = sessions(on_home, elsewhere);
        let fleet = fleet([cap, cap]);
        let d = p.select(&turn(1, next, 10), FleetView { replicas: &fleet });
        let case = format!("{on_home} {elsewhere} {next}: {d:?}");
        assert_eq!(d.ranked[0].replica, ReplicaId(to), "{case}");
        assert_eq!(d.session_past_cache, to == 1, "{case}");
        // Its history at home counts as gone where it moves: it would be evicted first.
        let home = d.ranked.iter().find(|c| c.replica == ReplicaId(0));
        let held = home.map(|c| c.prefix_blocks);
        assert_eq!(held == Some(0.0), to == 1, "{case}");
    }
}

#[test]
fn without_a_reported_cache_or_a_home_seen_recomputing_a_session_keeps_its_home() {
    let p = sessions(6_000, 2_000);
    for caps in [[None, None], [None, Some(10_000)]] {
        let fleet = fleet(caps);
        let d = p.select(&turn(1, 4_500, 10), FleetView { replicas: &fleet });
        assert_eq!(d.ranked[0].replica, ReplicaId(0), "{caps:?}");
        assert!(!d.session_past_cache);
    }
    // Past its cache by the count, but its events show it keeping what it holds.
    let mut quiet = policy_with(2, PolicyConfig::default());
    quiet.record(ReplicaId(0), &turn(1, 3_000, 0));
    quiet.record(ReplicaId(0), &turn(2, 6_000, 0));
    let fleet = fleet([Some(10_000), Some(10_000)]);
    let d = quiet.select(&turn(1, 4_500, 10), FleetView { replicas: &fleet });
    assert_eq!(d.ranked[0].replica, ReplicaId(0), "{d:?}");
    assert!(!d.session_past_cache);
}

#[test]
fn a_sessions_own_history_counts_once_and_fades_with_its_traffic() {
    // Replica 1 has room for any of these turns: only whether the home is past its cache
    // decides.
    let mut p = sessions(6_000, 0);
    let fleet = fleet([Some(10_000), Some(10_000)]);
    // Its turns on the home replace its last length there: ten turns of 3,500 are 3,500 live.
    for t in 1..=10 {
        p.record(ReplicaId(0), &turn(1, 3_500, t));
    }
    let d = p.select(&turn(1, 3_900, 11), FleetView { replicas: &fleet });
    assert!(!d.session_past_cache, "{d:?}");
    assert_eq!(d.ranked[0].replica, ReplicaId(0));
    // Ten half-lives later the others' histories have faded: a long turn fits at home.
    let later = 10 * PolicyConfig::default().traffic_half_life_ms;
    let d = p.select(&turn(1, 9_000, later), FleetView { replicas: &fleet });
    assert!(!d.session_past_cache, "{d:?}");
}

proptest! {
    /// Whatever the caches and however the sessions grow: a gateway told the same decisions
    /// (a peer's) ranks every turn alike, no turn is past a cache the agents do not report or
    /// that holds every history, and on an idle fleet a turn past its home's cache goes elsewhere.
    #[test]
    fn sessions_past_their_caches_rank_alike_on_peers(
        turns in prop::collection::vec((0u64..12, 1u64..40), 1..150),
        n in 1u32..6,
        cap in prop::sample::select(vec![None, Some(1_000u64), Some(5_000), Some(1_000_000_000)]),
        busy in 0u32..6,
    ) {
        let (mut p, mut peer) = (policy_with(n, PolicyConfig::default()), policy_with(n, PolicyConfig::default()));
        // Some replica's events show it computing again what it evicted (or none's).
        if busy < n {
            recomputing(&mut p, ReplicaId(busy));
            recomputing(&mut peer, ReplicaId(busy));
        }
        let mut fleet = view(&vec![0; n as usize]);
        for r in &mut fleet {
            r.kv_capacity_tokens = cap;
        }
        let mut length = [0u64; 12];
        for (k, &(s, grow)) in turns.iter().enumerate() {
            length[s as usize] += grow * 100;
            let f = turn(s + 1, length[s as usize], k as u64);
            let d = p.select(&f, FleetView { replicas: &fleet });
            prop_assert_eq!(&d, &peer.select(&f, FleetView { replicas: &fleet }));
            if cap.is_none_or(|c| c >= 1_000_000_000) {
                prop_assert!(!d.session_past_cache);
            }
            let home = p.sessions.get(s + 1, f.now_ms, p.config().session_ttl_ms);
            if d.session_past_cache {
                prop_assert_ne!(Some(d.ranked[0].replica), home, "{:?}", d);
            }
            p.record_choice(&d.ranked[0], &f);
            peer.record(d.ranked[0].replica, &f);
        }
    }
}
