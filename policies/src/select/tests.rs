//! Ranking tests: prefix, ring, load caps, the imbalance guard, the prefill signal, and the
//! properties (bounded load, deterministic and complete rankings).

use super::*;
use crate::ReplicaView;
use proptest::prelude::*;

mod hot_group;
mod kv_room;
mod kv_wait;
mod saturation;
mod session_room;
mod sessions;
mod spread;
mod step_wait;
mod ties;

/// The bounded-load policy these tests exercise: caps over the mean load with a bonus for
/// holders, the imbalance guard, bounded traffic, the ring's vote and the hard limits (the
/// default before the hot-group rule; the default keeps every mechanism but turns these off).
fn bounded_load() -> PolicyConfig {
    let mut weights = crate::Weights::default();
    weights.0[Signal::Prefix] = 3.0;
    weights.0[Signal::Ring] = 1.0;
    PolicyConfig {
        weights,
        load_factor: 1.25,
        cached_load_bonus: 0.5,
        imbalance_factor: 3.0,
        min_load_cap: 8,
        traffic_bound: 1.0,
        kv_saturation: 0.9,
        queue_saturation: 16,
        recompute_penalty: 0.0,
        ..Default::default()
    }
}

fn policy(n: u32) -> Policy {
    policy_with(n, bounded_load())
}

/// The caps without their floor (`min_load_cap: 1`): the bounded-load arithmetic at the small
/// counts these tests use.
fn unfloored() -> PolicyConfig {
    PolicyConfig {
        min_load_cap: 1,
        ..bounded_load()
    }
}

/// A policy over `n` replicas that has routed one request of another group, so that the
/// group a test routes is not all the traffic (which would make it hot at once).
fn policy_with(n: u32, config: PolicyConfig) -> Policy {
    let mut p = policy_without_traffic(n, config);
    p.record(ReplicaId(n - 1), &features(u64::MAX, &[u64::MAX]));
    p
}

fn policy_without_traffic(n: u32, config: PolicyConfig) -> Policy {
    let mut p = Policy::new(config);
    let names: Vec<String> = (0..n).map(|i| format!("http://replica-{i}")).collect();
    let members: Vec<(ReplicaId, &str)> = names
        .iter()
        .enumerate()
        .map(|(i, s)| (ReplicaId(i as u32), s.as_str()))
        .collect();
    p.set_members(&members);
    p
}

fn view(loads: &[u32]) -> Vec<ReplicaView> {
    loads
        .iter()
        .enumerate()
        .map(|(i, &l)| ReplicaView {
            id: ReplicaId(i as u32),
            healthy: true,
            in_flight: l,
            ..ReplicaView::default()
        })
        .collect()
}

/// Routes `f` on an idle three-replica fleet and records the choice: its home.
fn place_on_idle(p: &mut Policy, f: &RequestFeatures) -> ReplicaId {
    let home = p
        .select(
            f,
            FleetView {
                replicas: &view(&[0, 0, 0]),
            },
        )
        .ranked[0]
        .replica;
    p.record(home, f);
    home
}

fn features(key: u64, chunks: &[u64]) -> RequestFeatures {
    RequestFeatures {
        prefix_chunks: chunks.to_vec(),
        ring_key: key,
        ..Default::default()
    }
}

/// A group hot on three of four replicas, each of them 300 prompt tokens behind: 200 of its
/// requests recorded there, and the fleet as reported (the fourth idle).
fn hot_on_three_of_four(f: &RequestFeatures) -> (Policy, Vec<ReplicaView>) {
    let mut p = policy_with(4, PolicyConfig::default());
    for i in 0..200 {
        p.record(ReplicaId(i % 3), f);
    }
    let mut fleet = view(&[1, 1, 1, 1]);
    for r in &mut fleet[..3] {
        r.prefill_backlog = 300;
    }
    (p, fleet)
}

#[test]
fn a_session_keeps_its_replica_until_saturation_or_expiry() {
    let mut p = policy(4);
    let mut fleet = view(&[0, 0, 0, 0]);
    let turn = |key: u64, now_ms: u64| RequestFeatures {
        session: Some(77),
        now_ms,
        ..features(key, &[key])
    };
    let first = p.select(&turn(1, 0), FleetView { replicas: &fleet });
    let home = first.ranked[0].replica;
    p.record(home, &turn(1, 0));
    // Unrelated prompts (other ring owners, no shared prefix) follow the session.
    for (i, key) in (2..12u64).enumerate() {
        let f = turn(key * 7919, 1000 * i as u64);
        let d = p.select(&f, FleetView { replicas: &fleet });
        assert_eq!(d.ranked[0].replica, home, "turn {i}");
        assert_eq!(d.ranked[0].signals[Signal::Session], 1.0);
        p.record(home, &f);
    }
    // Saturated: the session yields.
    fleet[home.0 as usize].in_flight = 10;
    let d = p.select(&turn(5, 20_000), FleetView { replicas: &fleet });
    assert_ne!(d.ranked[0].replica, home);
    // Idle past the TTL: the binding is gone.
    fleet[home.0 as usize].in_flight = 0;
    let late = 20_000 + p.config().session_ttl_ms;
    let d = p.select(&turn(5, late), FleetView { replicas: &fleet });
    assert!(d.ranked.iter().all(|c| c.signals[Signal::Session] == 0.0));
}

#[test]
fn cold_prefix_goes_to_the_ring_owner_and_warm_prefix_sticks() {
    let mut p = policy(4);
    let fleet = view(&[0, 0, 0, 0]);
    let f = features(12345, &[1, 2, 3]);
    let first = p.select(&f, FleetView { replicas: &fleet });
    let owner = first.ranked[0].replica;
    assert_eq!(first.ranked[0].signals[Signal::Ring], 1.0);
    p.record(owner, &f);
    // Same prefix, different ring key (e.g. a different suffix): the prefix holder wins.
    let again = p.select(
        &features(999, &[1, 2, 3, 4]),
        FleetView { replicas: &fleet },
    );
    assert_eq!(again.ranked[0].replica, owner);
    assert_eq!(again.ranked[0].signals[Signal::Prefix], 0.75);
}

#[test]
fn bounded_traffic_moves_the_cold_owner_but_not_a_holder() {
    // The group's traffic below would make it hot, and a hot group spreads (its own rule).
    let config = PolicyConfig {
        traffic_bound: 1.0,
        hot_group_factor: 1000.0,
        ..bounded_load()
    };
    let mut p = policy_with(4, config);
    let fleet = view(&[0, 0, 0, 0]);
    let warm = features(12345, &[1, 2, 3]);
    let home = p.select(&warm, FleetView { replicas: &fleet }).ranked[0].replica;
    // Its group brings traffic: the home carries far more than its share.
    for now_ms in 0..20 {
        p.record(
            home,
            &RequestFeatures {
                now_ms,
                ..warm.clone()
            },
        );
    }
    let d = p.select(&warm, FleetView { replicas: &fleet });
    assert_eq!(d.ranked[0].replica, home, "the holder keeps its group");
    assert_eq!(d.ranked[0].signals[Signal::Ring], 0.0);
    // A cold prompt whose ring owner is the busy home goes to its next replica instead.
    let cold_on_home = (0..10_000u64)
        .map(|key| features(key, &[key + 1_000]))
        .find(|f| policy(4).select(f, FleetView { replicas: &fleet }).ranked[0].replica == home)
        .unwrap();
    let d = p.select(&cold_on_home, FleetView { replicas: &fleet });
    assert_ne!(d.ranked[0].replica, home);
    assert_eq!(d.ranked[0].signals[Signal::Ring], 1.0);
    // Off, the ring owner is the home again.
    let off = policy(4);
    let d = off.select(&cold_on_home, FleetView { replicas: &fleet });
    assert_eq!(d.ranked[0].replica, home);
}

#[test]
fn cached_load_bonus_keeps_a_prompt_home_past_the_cold_bound() {
    let config = PolicyConfig {
        cached_load_bonus: 0.5,
        imbalance_factor: 0.0,
        ..unfloored()
    };
    let mut p = policy_with(3, config);
    let f = features(7, &[1, 2]);
    let home = place_on_idle(&mut p, &f);
    let loads_with_home_at = |load: u32| {
        let mut loads = [3u32; 3];
        loads[home.0 as usize] = load;
        view(&loads)
    };
    // 7 in flight: over the cold bound ceil(1.25 * 14 / 3) = 6, under the home's cap
    // ceil((1.25 + 0.5) * 14 / 3) = 9.
    let d = p.select(
        &f,
        FleetView {
            replicas: &loads_with_home_at(7),
        },
    );
    assert_eq!(d.load_bound, 6);
    assert_eq!((d.ranked[0].replica, d.ranked[0].load_cap), (home, 9));
    assert!(d.ranked[1..].iter().all(|c| c.load_cap == 6));
    // 10 in flight reaches its cap, ceil(1.75 * 17 / 3) = 10: the prompt spills.
    let d = p.select(
        &f,
        FleetView {
            replicas: &loads_with_home_at(10),
        },
    );
    assert_ne!(d.ranked[0].replica, home);
    // A prompt nobody holds is placed under the cold bound everywhere.
    let cold = p.select(
        &features(8, &[5, 6]),
        FleetView {
            replicas: &loads_with_home_at(7),
        },
    );
    assert!(cold.ranked.iter().all(|c| c.load_cap == 6));
}

#[test]
fn a_replica_without_the_shared_prefix_does_not_starve() {
    let config = |imbalance_factor| PolicyConfig {
        imbalance_factor,
        ..unfloored()
    };
    let shared = RequestFeatures {
        prompt_tokens: 1_000,
        ..features(3, &[1, 2, 3])
    };
    let busy = view(&[1, 4, 1, 1]);
    for factor in [2.0, 0.0] {
        let mut p = policy_with(4, config(factor));
        p.record(ReplicaId(1), &shared);
        let pick = p.select(&shared, FleetView { replicas: &busy }).ranked[0].replica;
        if factor > 0.0 {
            // 4 in flight is 2 x (1 + 1), and a holder's cap is ceil(1.75 * 8 / 4) = 4.
            assert_ne!(pick, ReplicaId(1));
        } else {
            // Without the guard the holder keeps it: at its cap, it still has the least
            // to prefill.
            assert_eq!(pick, ReplicaId(1));
        }
    }
}

#[test]
fn the_guard_is_never_below_a_holders_cap() {
    // One replica has just drained (0 in flight) while the home has 11: 3 x (0 + 1) would
    // make it spill, and so would the cold bound ceil(1.25 * 30 / 4) = 10, but a replica
    // holding the whole prompt may carry ceil(1.75 * 30 / 4) = 14.
    let mut p = policy(4);
    let shared = features(3, &[1, 2, 3]);
    p.record(ReplicaId(1), &shared);
    let d = p.select(
        &shared,
        FleetView {
            replicas: &view(&[0, 11, 9, 9]),
        },
    );
    assert_eq!(d.ranked[0].replica, ReplicaId(1));
}

#[test]
fn a_prefill_backlog_steers_a_cold_prompt_past_its_ring_owner() {
    let p = policy(3);
    let f = RequestFeatures {
        prompt_tokens: 2_000,
        ..features(7, &[1, 2, 3, 4])
    };
    let idle = view(&[1, 1, 1]);
    let owner = p.select(&f, FleetView { replicas: &idle }).ranked[0].replica;
    // As many requests everywhere, but the owner is prefilling a long document.
    let mut busy = idle.clone();
    busy[owner.0 as usize].prefill_backlog = 30_000;
    let d = p.select(&f, FleetView { replicas: &busy });
    assert_ne!(d.ranked[0].replica, owner);
    assert_eq!(d.ranked[0].signals[Signal::Prefill], 1.0);
    assert_eq!(d.ranked[0].prefill_tokens, 2_000);
    let o = d.ranked.iter().find(|c| c.replica == owner).unwrap();
    assert_eq!(o.signals[Signal::Ring], 1.0);
    assert!(
        o.signals[Signal::Prefill] < 0.2,
        "{}",
        o.signals[Signal::Prefill]
    );
}

#[test]
fn a_held_prompt_outweighs_a_short_backlog() {
    let mut p = policy(3);
    let f = RequestFeatures {
        prompt_tokens: 1_000,
        ..features(7, &[1, 2, 3, 4])
    };
    let home = place_on_idle(&mut p, &f);
    let mut fleet = view(&[1, 1, 1]);
    fleet[home.0 as usize].prefill_backlog = 500;
    // Another ring key: only what the replicas hold tells them apart.
    let again = RequestFeatures {
        ring_key: 999,
        ..f.clone()
    };
    let d = p.select(&again, FleetView { replicas: &fleet });
    assert_eq!(d.ranked[0].replica, home);
    assert_eq!(d.ranked[0].prefill_tokens, 0);
    // 500 tokens ahead at home against 1,000 to compute anywhere else.
    assert_eq!(d.ranked[0].signals[Signal::Prefill], 1.0);
    assert_eq!(d.ranked[1].signals[Signal::Prefill], 0.75);
}

#[test]
fn the_recompute_penalty_keeps_a_holder_past_a_backlog_longer_than_the_prompt() {
    let only_prefill = |penalty: f64| {
        let mut weights = crate::Weights(BySignal::default());
        weights.0[Signal::Prefill] = 1.0;
        PolicyConfig {
            weights,
            recompute_penalty: penalty,
            ..bounded_load()
        }
    };
    let f = RequestFeatures {
        prompt_tokens: 1_000,
        ..features(7, &[1, 2, 3, 4])
    };
    let again = RequestFeatures {
        ring_key: 999,
        ..f.clone()
    };
    for (penalty, holder_wins) in [(0.0, false), (1.0, true)] {
        let mut p = policy_with(2, only_prefill(penalty));
        let home = place_on_idle(&mut p, &f);
        let mut fleet = view(&[1, 1]);
        // 1,500 tokens ahead at home; elsewhere all 1,000 again, counted twice with the
        // penalty.
        fleet[home.0 as usize].prefill_backlog = 1_500;
        let d = p.select(&again, FleetView { replicas: &fleet });
        assert_eq!(
            d.ranked[0].replica == home,
            holder_wins,
            "penalty {penalty}"
        );
    }
}

#[test]
fn unhealthy_replicas_are_filtered_and_an_empty_fleet_ranks_nothing() {
    let p = policy(2);
    let mut fleet = view(&[0, 0]);
    fleet[0].healthy = false;
    let d = p.select(&features(1, &[]), FleetView { replicas: &fleet });
    assert_eq!(
        d.ranked.iter().map(|c| c.replica).collect::<Vec<_>>(),
        vec![ReplicaId(1)]
    );
    fleet[1].healthy = false;
    assert!(p
        .select(&features(1, &[]), FleetView { replicas: &fleet })
        .ranked
        .is_empty());
}

proptest! {
    /// Bounded load: routing each new request to the top candidate and counting it in
    /// flight never pushes a replica past ceil(c * total / n) for cold prefixes, nor past
    /// ceil((c + bonus) * total / n) where it holds the prompt, unless the prefill signal
    /// (load in tokens) keeps it there; and nothing, whatever the prefill backlogs, pushes
    /// a replica past the imbalance guard. Every cap is at least `min_load_cap`, and neither
    /// the recompute penalty (whole, by length, or lifted where empty KV blocks take a copy)
    /// nor the traffic bound changes any of it.
    #[test]
    fn bounded_load_holds(
        requests in prop::collection::vec((any::<u64>(), 0u64..6, 0u64..20_000), 1..200),
        n in 1u32..9,
        bonus in prop::sample::select(vec![0.0, 0.5, 1.0]),
        imbalance in prop::sample::select(vec![0.0, 2.0, 3.0]),
        prefill in prop::sample::select(vec![0.0, 6.0]),
        min_cap in prop::sample::select(vec![1u32, 4, 8]),
        penalty in prop::sample::select(vec![0.0, 1.0, 4.0]),
        full_at in prop::sample::select(vec![0u64, 2_048]),
        traffic in prop::sample::select(vec![0.0, 1.0, 1.5]),
        room in prop::sample::select(vec![None, Some(0u64), Some(1_000_000)]),
    ) {
        let mut config = PolicyConfig {
            cached_load_bonus: bonus,
            imbalance_factor: imbalance,
            min_load_cap: min_cap,
            recompute_penalty: penalty,
            recompute_penalty_full_at: full_at,
            traffic_bound: traffic,
            ..bounded_load()
        };
        config.weights.0[Signal::Prefill] = prefill;
        let mut p = policy_with(n, config);
        let c = p.config().load_factor;
        let mut loads = vec![0u32; n as usize];
        let mut backlogs = vec![0u64; n as usize];
        for (k, &(key, group, backlog)) in requests.iter().enumerate() {
            // Group 0 is a cold, unshared prompt; the others recur.
            let chunks: Vec<u64> = if group == 0 { vec![] } else { vec![group, group + 100] };
            let f = RequestFeatures { prompt_tokens: 1_000, ..features(key, &chunks) };
            // Prefill backlogs unrelated to the request counts: the bound holds anyway.
            backlogs[k % n as usize] = backlog;
            let mut fleet = view(&loads);
            for (r, &b) in fleet.iter_mut().zip(&backlogs) {
                r.prefill_backlog = b;
                // KV to spare, so that a short recompute weighs by its length.
                r.kv_usage = Some(0.1);
                r.kv_empty_tokens = room;
            }
            let least = *loads.iter().min().unwrap();
            let d = p.select(&f, FleetView { replicas: &fleet });
            let pick = d.ranked[0];
            p.record_choice(&pick, &f);
            let i = pick.replica.0 as usize;
            loads[i] += 1;
            let cap_at = |factor: f64| ((factor * (k + 1) as f64 / f64::from(n)).ceil() as u32).max(min_cap);
            let cap = cap_at(if pick.prefix_blocks > 0.0 { c + bonus } else { c });
            prop_assert!(pick.load_cap <= cap);
            if prefill == 0.0 {
                prop_assert!(loads[i] <= cap, "load {} over cap {}", loads[i], cap);
            }
            if imbalance > 0.0 {
                let guard = ((imbalance * f64::from(least + 1)).ceil() as u32).max(cap_at(c + bonus));
                prop_assert!(loads[i] <= guard, "load {} over {}x the idlest or a holder's cap", loads[i], imbalance);
            }
        }
    }

    /// Bounded traffic: cold prompts placed one by one on an idle fleet give no replica more
    /// than `traffic_bound * m / n + 1` of m, wherever their ring keys fall; a gateway told
    /// the same decisions ranks every prompt alike.
    #[test]
    fn bounded_traffic_spreads_cold_prompts(
        keys in prop::collection::vec(any::<u64>(), 1..120),
        n in 1u32..17,
        bound in prop::sample::select(vec![1.0, 1.25, 2.0]),
    ) {
        let config = PolicyConfig { traffic_bound: bound, ..bounded_load() };
        let (mut p, mut peer) = (
            policy_without_traffic(n, config.clone()),
            policy_without_traffic(n, config),
        );
        let fleet = view(&vec![0; n as usize]);
        let mut placed = vec![0u32; n as usize];
        for (k, &key) in keys.iter().enumerate() {
            let f = RequestFeatures { now_ms: k as u64, ..features(key, &[key, key ^ 1]) };
            let d = p.select(&f, FleetView { replicas: &fleet });
            prop_assert_eq!(&d, &peer.select(&f, FleetView { replicas: &fleet }));
            let pick = d.ranked[0].replica;
            p.record_choice(&d.ranked[0], &f);
            peer.record(pick, &f);
            placed[pick.0 as usize] += 1;
        }
        let most = f64::from(*placed.iter().max().unwrap());
        // Within a millisecond apart over 120 ms, a 10 s half-life decays nothing that matters.
        let limit = bound * keys.len() as f64 / f64::from(n) + 1.0 + 0.05;
        prop_assert!(most <= limit, "{placed:?}: {most} over {limit}");
    }

    /// A holder below its cap keeps its group, whatever the fleet's loads and recent traffic
    /// (the traffic bound moves only the ring owner).
    #[test]
    fn a_holder_within_its_bound_keeps_its_group(
        loads in prop::collection::vec(0u32..12, 2..9),
        history in prop::collection::vec(0usize..8, 0..200),
        holder in 0usize..8,
        key in any::<u64>(),
    ) {
        let n = loads.len();
        let holder = holder % n;
        let mut p = policy(n as u32);
        for (t, &r) in history.iter().enumerate() {
            let other = features(t as u64, &[1_000 + t as u64]);
            p.record(ReplicaId((r % n) as u32), &RequestFeatures { now_ms: t as u64, ..other });
        }
        let group = RequestFeatures { prompt_tokens: 1_000, now_ms: 200, ..features(key, &[7, 8, 9]) };
        p.record(ReplicaId(holder as u32), &group);
        let d = p.select(&group, FleetView { replicas: &view(&loads) });
        let home = d.ranked.iter().find(|c| c.replica.0 as usize == holder).unwrap();
        prop_assume!(!home.saturated);
        prop_assert_eq!(d.ranked[0].replica, home.replica, "{:?}", d.ranked);
    }

    #[test]
    fn ranking_is_deterministic_and_complete(key in any::<u64>(), loads in prop::collection::vec(0u32..10, 1..12)) {
        let p = policy(loads.len() as u32);
        let fleet = view(&loads);
        let a = p.select(&features(key, &[]), FleetView { replicas: &fleet });
        let b = p.select(&features(key, &[]), FleetView { replicas: &fleet });
        prop_assert_eq!(&a, &b);
        let mut ranked: Vec<u32> = a.ranked.iter().map(|c| c.replica.0).collect();
        ranked.sort();
        prop_assert_eq!(ranked, (0..loads.len() as u32).collect::<Vec<_>>());
        for top in 0..=loads.len() + 1 {
            let head = p.select_top(&features(key, &[]), FleetView { replicas: &fleet }, top);
            prop_assert_eq!(&head.ranked[..], &a.ranked[..top.min(loads.len())]);
        }
    }
}

#[test]
fn the_breakdown_names_every_signal() {
    let p = policy_with(2, unfloored());
    let d = p.select(
        &features(1, &[1, 2]),
        FleetView {
            replicas: &view(&[0, 3]),
        },
    );
    let line = d.ranked[0].breakdown();
    for s in Signal::ALL {
        assert!(line.contains(&format!(";{}=", s.name())), "{line}");
    }
    assert!(
        line.starts_with("total=") && line.contains(";in_flight=0;"),
        "{line}"
    );
}
