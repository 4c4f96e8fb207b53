//! The default policy's recompute rule: a prefix another replica holds costs its recompute
//! `1 + recompute_penalty` times (less for a short recompute of a recurring group), unless its
//! group is hot or the request is a session's.

use super::*;

/// The default with only the prefill signal weighed: the rule alone decides.
fn prefill_only() -> PolicyConfig {
    let mut weights = crate::Weights(BySignal::default());
    weights.0[Signal::Prefill] = 1.0;
    PolicyConfig {
        weights,
        ..Default::default()
    }
}

fn prompt(tokens: u64) -> RequestFeatures {
    RequestFeatures {
        prompt_tokens: tokens,
        ..features(7, &[1, 2, 3, 4, 5, 6, 7, 8])
    }
}

/// Replica 0 holds the prompt, with `backlog` tokens ahead; the others are idle.
fn held_by_first(backlog: u64, n: usize) -> Vec<ReplicaView> {
    let mut fleet = view(&vec![1; n]);
    fleet[0].prefill_backlog = backlog;
    fleet
}

#[test]
fn a_hot_group_spreads_past_its_holders_and_a_cold_one_stays() {
    let f = prompt(1_000);
    // Three of four replicas hold the group; 3 of its requests, or 200 (all the traffic).
    for (requests, spreads) in [(3, false), (200, true)] {
        let mut p = policy_with(4, PolicyConfig::default());
        for i in 0..requests {
            p.record(ReplicaId(i % 3), &f);
        }
        let mut fleet = view(&[1, 1, 1, 1]);
        for r in &mut fleet[..3] {
            r.prefill_backlog = 300;
        }
        let d = p.select(&f, FleetView { replicas: &fleet });
        assert_eq!(d.ranked[0].replica == ReplicaId(3), spreads, "{requests}");
        assert_eq!(d.hot_group, spreads, "{requests}");
        // The explain still says what the spill computes.
        let idle = d.ranked.iter().find(|c| c.replica == ReplicaId(3)).unwrap();
        assert_eq!(idle.prefill_tokens, 1_000);
    }
}

#[test]
fn a_short_recompute_of_a_recurring_group_costs_its_share_of_the_penalty() {
    // Replica 0 holds the 1,000-token prompt with `backlog` tokens queued; replica 1 is idle,
    // 10 % of its KV in use, and would recompute all of it: 1,000 + 2,000 with the whole
    // penalty, 1,000 + 500 with a quarter of it (`full_at` 4,000). Three requests of the group
    // recur on two replicas; one does not, and keeps the whole penalty.
    let f = prompt(1_000);
    for (full_at, requests, backlog, spills) in [
        (0, 3, 1_600, false),
        (4_000, 3, 1_600, true),
        (4_000, 3, 1_200, false),
        (4_000, 1, 1_600, false),
    ] {
        let mut p = policy_with(
            2,
            PolicyConfig {
                recompute_penalty_full_at: full_at,
                ..prefill_only()
            },
        );
        for _ in 0..requests {
            p.record(ReplicaId(0), &f);
        }
        let mut fleet = held_by_first(backlog, 2);
        fleet[1].kv_usage = Some(0.1);
        let d = p.select(&f, FleetView { replicas: &fleet });
        assert!(!d.hot_group);
        assert_eq!(
            d.ranked[0].replica == ReplicaId(1),
            spills,
            "full_at {full_at}, {requests} requests, {backlog} queued"
        );
    }
}

#[test]
fn a_holder_keeps_its_group_past_a_longer_backlog_where_the_whole_fleet_is_busy() {
    // Replica 0 holds the 1,000-token prompt of a cold group; a copy elsewhere costs 1,000
    // tokens and 2,000 of penalty, times the prompts the fleet has ahead on average. With the
    // others idle, a 4,000-token backlog at the holder spills (4,000 against 1,000 + 2,000 x
    // 1.33). With 3,000 ahead at each of them, 7,000 at the holder does not (7,000 against
    // 3,000 + 1,000 + 2,000 x 4.33), where a fleet counted as idle would move it to a queue
    // that a copy makes longer (6,000).
    let f = prompt(1_000);
    for (holder, others, spills) in [(4_000, 0, true), (7_000, 3_000, false)] {
        let mut p = policy_with(3, prefill_only());
        p.record(ReplicaId(0), &f);
        let mut fleet = held_by_first(holder, 3);
        for r in &mut fleet[1..] {
            r.prefill_backlog = others;
        }
        let d = p.select(&f, FleetView { replicas: &fleet });
        assert!(!d.hot_group);
        assert_eq!(d.ranked[0].replica != ReplicaId(0), spills, "{d:?}");
    }
}

#[test]
fn a_hot_group_is_copied_only_where_no_prefill_is_queued() {
    // The group is hot on three of four replicas, 300 tokens queued at each holder. A copy to
    // a fourth replica with a prefill queued would put the whole prompt ahead of that queue:
    // 1,100 tokens there against 300 at a holder.
    let f = prompt(1_000);
    for (queued, spreads) in [(0, true), (100, false)] {
        let (p, mut fleet) = hot_on_three_of_four(&f);
        fleet[3].prefill_backlog = queued;
        let d = p.select(&f, FleetView { replicas: &fleet });
        assert!(d.hot_group);
        assert_eq!(d.ranked[0].replica == ReplicaId(3), spreads, "{queued}");
    }
}

#[test]
fn a_group_that_is_all_the_traffic_is_hot_within_a_few_dozen_requests() {
    // Three of four replicas hold it, so it is hot past three quarters of the traffic. A
    // count of requests out of `n` is binomial: when it is all of them, its noise is a
    // fraction of a Poisson count's (which would take some 130 requests here).
    let f = prompt(1_000);
    for (requests, hot) in [(30, false), (50, true)] {
        let mut p = policy_with(4, PolicyConfig::default());
        for i in 0..requests {
            p.record(ReplicaId(i % 3), &f);
        }
        let fleet = view(&[1, 1, 1, 1]);
        let d = p.select(&f, FleetView { replicas: &fleet });
        assert_eq!(d.hot_group, hot, "{requests}");
    }
}

#[test]
fn a_group_that_is_all_the_traffic_yet_spreads_from_its_second_request() {
    // The first request went to replica 0, which holds the prompt and computes it; the rest
    // are idle. The second one's copy is worth making at once: no other group wants the idle
    // replicas. With a request of another group counted, the margin of a count's noise keeps
    // it on its holder, and so does a `hot_group_factor` at which one holder of four is its
    // fair share, and a fleet of two, where a copy would leave no replica for another group
    // that may yet come.
    let f = prompt(1_000);
    let factor = |hot_group_factor| PolicyConfig {
        hot_group_factor,
        ..Default::default()
    };
    for (n, mut p, spreads) in [
        (4, policy_without_traffic(4, factor(1.0)), true),
        (4, policy_with(4, factor(1.0)), false),
        (4, policy_without_traffic(4, factor(4.0)), false),
        (2, policy_without_traffic(2, factor(1.0)), false),
    ] {
        p.record(ReplicaId(0), &f);
        let fleet = held_by_first(1_000, n);
        let d = p.select(&f, FleetView { replicas: &fleet });
        assert_eq!(d.hot_group, spreads);
        assert_eq!(d.ranked[0].replica != ReplicaId(0), spreads, "{d:?}");
    }
}

#[test]
fn a_hot_groups_blocks_count_as_held_in_the_prefix_signal_too() {
    let f = prompt(1_000);
    for (requests, hot) in [(3, false), (200, true)] {
        let mut p = policy_with(4, PolicyConfig::default());
        for i in 0..requests {
            p.record(ReplicaId(i % 3), &f);
        }
        let d = p.select(
            &f,
            FleetView {
                replicas: &view(&[1, 1, 1, 1]),
            },
        );
        assert_eq!(d.hot_group, hot);
        let prefix = |r: u32| {
            let c = d.ranked.iter().find(|c| c.replica == ReplicaId(r)).unwrap();
            c.signals[Signal::Prefix]
        };
        // Stickiness to the holders would keep the fourth replica out of a group worth
        // spreading (with gateways that each see a share of its traffic, for good).
        assert_eq!(prefix(3) == prefix(0), hot, "{requests}");
        assert!(prefix(0) > 0.0);
    }
}

#[test]
fn a_sessions_history_moves_without_the_recompute_penalty() {
    let f = prompt(1_000);
    for (session, stays) in [(None, true), (Some(42), false)] {
        let mut p = policy_with(2, prefill_only());
        p.record(ReplicaId(0), &f);
        // 1,500 tokens ahead at the holder; 1,000 elsewhere, three times that with the penalty.
        let d = p.select(
            &RequestFeatures {
                session,
                ..f.clone()
            },
            FleetView {
                replicas: &held_by_first(1_500, 2),
            },
        );
        assert_eq!(d.ranked[0].replica == ReplicaId(0), stays, "{session:?}");
    }
}

#[test]
fn a_sessions_first_request_counts_what_its_groups_holders_have_as_held_everywhere() {
    let f = prompt(1_000);
    let mut p = policy_with(4, PolicyConfig::default());
    p.record(ReplicaId(0), &f);
    // The holder has 600 tokens queued: less than the prompt, more than nothing.
    let fleet = held_by_first(600, 4);
    let view = FleetView { replicas: &fleet };
    let plain = p.select(&f, view);
    assert_eq!(plain.ranked[0].replica, ReplicaId(0));
    assert!(!plain.opens_session && !plain.hot_group);

    // Opening a session places every turn to come: an idle replica, where the group's blocks
    // count as held as they do at the holder.
    let opening = RequestFeatures {
        session: Some(42),
        ..f.clone()
    };
    let d = p.select(&opening, view);
    assert!(d.opens_session && !d.hot_group, "{d:?}");
    assert_ne!(d.ranked[0].replica, ReplicaId(0), "{d:?}");
    assert!(d.ranked.iter().all(|c| c.signals[Signal::Prefix] == 1.0));
    // The explain still says what the new replica computes.
    assert_eq!(d.ranked[0].prefill_tokens, 1_000);

    // Once bound, the session's next request goes home and opens nothing.
    p.record_choice(&d.ranked[0], &opening);
    let next = p.select(&opening, view);
    assert_eq!(next.ranked[0].replica, d.ranked[0].replica);
    assert!(!next.opens_session);
}

proptest! {
    /// A group that is not hot stays with its holder while the backlog there is shorter than
    /// the prompt's recompute counted `1 + recompute_penalty` times (the penalty times over
    /// the prompts the fleet has ahead on average, where more than one), and spills past that.
    #[test]
    fn a_holder_keeps_its_group_up_to_the_penalised_recompute(
        tokens in 64u64..20_000,
        share in 0.0f64..2.0,
        n in 2usize..9,
    ) {
        let mut p = policy_with(n as u32, prefill_only());
        let f = prompt(tokens);
        p.record(ReplicaId(0), &f);
        let penalty = p.config().recompute_penalty;
        let backlog = (share * tokens as f64 * (1.0 + penalty)) as u64;
        let busy = (backlog as f64 / n as f64 / tokens as f64).max(1.0);
        let recompute = tokens as f64 * (1.0 + penalty * busy);
        prop_assume!((backlog as f64 - recompute).abs() > 1.0);
        let d = p.select(&f, FleetView { replicas: &held_by_first(backlog, n) });
        prop_assert_eq!(d.ranked[0].replica == ReplicaId(0), (backlog as f64) < recompute);
    }

    /// Two gateways told the same decisions (their own, or a peer's) rank alike: the group
    /// counts and the placements are a function of those decisions and the clock alone.
    #[test]
    fn gateways_told_the_same_decisions_rank_alike(
        sent in prop::collection::vec((0u32..4, 0u64..3), 1..200),
        backlogs in prop::collection::vec(0u64..5_000, 4),
    ) {
        let (mut a, mut b) = (policy_with(4, PolicyConfig::default()), policy_with(4, PolicyConfig::default()));
        let group = |g: u64| RequestFeatures {
            prompt_tokens: 1_000,
            ..features(g, &[g + 1, g + 2, g + 3, g + 4, g + 5])
        };
        for (i, &(replica, g)) in sent.iter().enumerate() {
            let f = RequestFeatures { now_ms: i as u64 * 10, ..group(g) };
            a.record(ReplicaId(replica), &f);
            b.record(ReplicaId(replica), &f);
        }
        let mut fleet = view(&[1, 1, 1, 1]);
        for (r, &backlog) in fleet.iter_mut().zip(&backlogs) {
            r.prefill_backlog = backlog;
        }
        // Groups 0-2 were sent; 9 is new (the spread signal counts placements).
        for g in [0, 1, 2, 9] {
            let f = RequestFeatures { now_ms: sent.len() as u64 * 10, ..group(g) };
            let view = FleetView { replicas: &fleet };
            prop_assert_eq!(a.select(&f, view), b.select(&f, view));
        }
    }
}

#[test]
fn a_prompt_sent_to_several_replicas_counts_on_each_and_heats_its_group_as_before() {
    // Token mode: 8 blocks of 16 tokens, sent to replicas 0, 1 and 2 in turn before any of
    // their events arrive.
    let f = RequestFeatures {
        block_hashes: (1..=8).collect(),
        prompt_tokens: 128,
        ring_key: 7,
        ..Default::default()
    };
    let mut p = policy_with(4, PolicyConfig::default());
    for i in 0..8 {
        p.record(ReplicaId(i % 3), &f);
    }
    let d = p.select(
        &f,
        FleetView {
            replicas: &view(&[1, 1, 1, 1]),
        },
    );
    let held = |r: u32| {
        d.ranked
            .iter()
            .find(|c| c.replica == ReplicaId(r))
            .map(|c| c.prefix_blocks)
    };
    assert_eq!(
        [held(0), held(1), held(2), held(3)],
        [Some(8.0), Some(8.0), Some(8.0), Some(0.0)],
        "each replica sent the prompt holds it until its events say otherwise"
    );
    // Its heat counts the latest decision's replica alone as a holder: 8 requests of all
    // the traffic are more than one replica's share; three holders' would want more.
    assert!(d.hot_group);
}

#[test]
fn a_group_is_hot_sooner_where_other_gateways_route_it_unseen() {
    // Replica 0 holds the group and has prefill queued; this gateway sent it five requests,
    // of six it sent. Alone, it would take seven to tell a trend. One of eight gateways that
    // share nothing has likely seen an eighth of the fleet's; with its seven peers telling
    // it theirs, it has seen them all.
    let f = prompt(1_000);
    for ((gateways, seen), hot) in [
        ((1, 1), false),
        ((8, 1), true),
        ((8, 8), false),
        ((16, 2), true),
    ] {
        let mut p = policy_with(4, PolicyConfig::default());
        p.set_gateways(gateways, seen);
        for _ in 0..5 {
            p.record(ReplicaId(0), &f);
        }
        let d = p.select(
            &f,
            FleetView {
                replicas: &held_by_first(300, 4),
            },
        );
        assert_eq!(d.hot_group, hot, "{gateways} gateways, {seen} seen");
        assert_eq!(d.ranked[0].replica != ReplicaId(0), hot, "{d:?}");
    }
}
