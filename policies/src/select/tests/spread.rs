//! The spread signal: a new group's first request goes where the fewest new groups' blocks were
//! placed recently, so that recurring groups share the fleet evenly.

use super::*;

/// Group `g`'s prompt: eight chunks of its own.
fn group(g: u64) -> RequestFeatures {
    let chunks: Vec<u64> = (1..=8).map(|i| g * 100 + i).collect();
    features(g, &chunks)
}

/// Two new groups placed on each of replicas 0, 1 and 2; none on 3.
fn placed_unevenly() -> Policy {
    let mut p = policy_without_traffic(4, PolicyConfig::default());
    for (g, replica) in [(1, 0), (2, 0), (3, 1), (4, 1), (5, 2), (6, 2)] {
        p.record(ReplicaId(replica), &group(g));
    }
    p
}

fn spread_of(d: &Decision) -> Vec<f64> {
    let mut by_replica: Vec<(u32, f64)> = d
        .ranked
        .iter()
        .map(|c| (c.replica.0, c.signals[Signal::Spread]))
        .collect();
    by_replica.sort_by_key(|x| x.0);
    by_replica.into_iter().map(|x| x.1).collect()
}

#[test]
fn new_groups_go_where_the_fewest_new_groups_were_placed() {
    let p = placed_unevenly();
    let fleet = view(&[0, 0, 0, 0]);
    // Ring order alone would scatter these over the fleet.
    for g in 10..20 {
        let d = p.select(&group(g), FleetView { replicas: &fleet });
        assert_eq!(d.ranked[0].replica, ReplicaId(3), "group {g}: {d:?}");
        let spread = spread_of(&d);
        assert_eq!(spread[3], 1.0);
        assert!(spread[..3].iter().all(|&s| s < 1.0), "{spread:?}");
    }
}

#[test]
fn a_group_seen_before_or_a_prompt_a_replica_holds_part_of_is_not_counted() {
    let p = placed_unevenly();
    let fleet = view(&[0, 0, 0, 0]);
    // Group 1 again: its holder decides.
    let d = p.select(&group(1), FleetView { replicas: &fleet });
    assert_eq!(spread_of(&d), vec![0.0; 4]);
    assert_eq!(d.ranked[0].replica, ReplicaId(0));
    // A new group (its fourth chunk differs) whose first chunk replica 0 holds.
    let mut chunks = group(1).prefix_chunks;
    chunks[3] = 999;
    let d = p.select(&features(77, &chunks), FleetView { replicas: &fleet });
    assert_eq!(spread_of(&d), vec![0.0; 4]);
    // Replica 0 leaves, and what it held with it: group 1 is cold again, but not new.
    let mut p = p;
    let names: Vec<String> = (1..4).map(|i| format!("http://replica-{i}")).collect();
    let members: Vec<(ReplicaId, &str)> = (1..4)
        .map(|i| (ReplicaId(i), names[i as usize - 1].as_str()))
        .collect();
    p.set_members(&members);
    let d = p.select(
        &group(1),
        FleetView {
            replicas: &fleet[1..],
        },
    );
    assert!(d.ranked.iter().all(|c| c.prefix_blocks == 0.0), "{d:?}");
    assert!(
        d.ranked.iter().all(|c| c.signals[Signal::Spread] == 0.0),
        "{d:?}"
    );
}

proptest! {
    /// The signal is in [0, 1] and falls as a replica's placed blocks grow: of two replicas,
    /// the one that placed fewer new groups' blocks scores higher.
    #[test]
    fn the_fewer_blocks_placed_the_higher_the_spread(
        history in prop::collection::vec((0u32..4, 1usize..9), 0..40),
    ) {
        let mut p = policy_without_traffic(4, PolicyConfig::default());
        let mut placed = [0usize; 4];
        for (i, &(replica, len)) in history.iter().enumerate() {
            let g = 1_000 + i as u64;
            let chunks: Vec<u64> = (1..=len as u64).map(|c| g * 100 + c).collect();
            p.record(ReplicaId(replica), &features(g, &chunks));
            placed[replica as usize] += len;
        }
        let d = p.select(&group(5), FleetView { replicas: &view(&[0, 0, 0, 0]) });
        let spread = spread_of(&d);
        for a in 0..4 {
            prop_assert!((0.0..=1.0).contains(&spread[a]));
            for b in 0..4 {
                if placed[a] < placed[b] {
                    prop_assert!(spread[a] > spread[b], "{placed:?} {spread:?}");
                }
            }
        }
    }
}

#[test]
fn a_new_prefix_goes_to_its_ring_owner_where_gateways_route_unseen() {
    // Keys spread over the ring, so that the groups have different owners.
    let prompt = |g: u64| RequestFeatures {
        prompt_tokens: 1_000,
        ring_key: g.wrapping_mul(0x9e37_79b9_7f4a_7c15),
        ..group(g)
    };
    let owner = |d: &Decision| {
        d.ranked
            .iter()
            .min_by_key(|c| c.ring_distance)
            .unwrap()
            .replica
    };
    let mut owners = std::collections::BTreeSet::new();
    for ((gateways, seen), agreed) in [((1, 1), false), ((8, 8), false), ((8, 1), true)] {
        let mut p = placed_unevenly();
        p.set_gateways(gateways, seen);
        for g in 10..20 {
            let mut fleet = view(&[0, 0, 0, 0]);
            let d = p.select(&prompt(g), FleetView { replicas: &fleet });
            let first = owner(&d);
            owners.insert(first);
            let to = if agreed { first } else { ReplicaId(3) };
            assert_eq!(
                d.ranked[0].replica, to,
                "{gateways}/{seen}, group {g}: {d:?}"
            );
            if !agreed {
                continue;
            }
            // Its vote is worth one prompt's prefill: less queued there keeps it, more does not.
            fleet[first.0 as usize].prefill_backlog = 500;
            let d = p.select(&prompt(g), FleetView { replicas: &fleet });
            assert_eq!(d.ranked[0].replica, first, "group {g}: {d:?}");
            fleet[first.0 as usize].prefill_backlog = 3_000;
            let d = p.select(&prompt(g), FleetView { replicas: &fleet });
            assert_ne!(d.ranked[0].replica, first, "group {g}: {d:?}");
        }
    }
    assert!(owners.len() > 1, "the groups' owners: {owners:?}");
}

#[test]
fn the_ring_owners_vote_for_a_new_prefix_is_worth_what_prompts_lately_shared() {
    // Token mode: a new group's prompt of 10 blocks, 1,000 tokens.
    let prompt = |g: u64| RequestFeatures {
        prompt_tokens: 1_000,
        block_hashes: (0..10).map(|b| g << 32 | b).collect(),
        ring_key: g.wrapping_mul(0x9e37_79b9_7f4a_7c15),
        ..Default::default()
    };
    // Where the owner of `g` goes with `backlog` tokens queued there, through 8 gateways
    // this one does not hear from, after prompts that found `held` of their 10 blocks held.
    let kept = |held: f64, backlog: u64| {
        let mut p = policy_without_traffic(4, PolicyConfig::default());
        p.set_gateways(8, 1);
        if held > 0.0 {
            let sent = Candidate {
                replica: ReplicaId(0),
                total: 0.0,
                signals: BySignal::default(),
                ring_distance: 0,
                saturated: false,
                load_cap: 0,
                prefix_blocks: held,
                prefill_tokens: 0,
                prefill_backlog: 0,
                step_wait: 0,
                kv_wait: 0,
                in_flight: 0,
            };
            p.record_choice(&sent, &prompt(1));
        }
        let mut fleet = view(&[0, 0, 0, 0]);
        let d = p.select(&prompt(7), FleetView { replicas: &fleet });
        let owner = d
            .ranked
            .iter()
            .min_by_key(|c| c.ring_distance)
            .unwrap()
            .replica;
        fleet[owner.0 as usize].prefill_backlog = backlog;
        let d = p.select(&prompt(7), FleetView { replicas: &fleet });
        d.ranked[0].replica == owner
    };
    // Before any prompt was found held, the owner is kept with up to two prompts queued.
    assert!(kept(0.0, 1_500));
    assert!(!kept(0.0, 2_500));
    // Prompts lately shared a fifth: up to two fifths of a prompt.
    assert!(kept(2.0, 200));
    assert!(!kept(2.0, 700));
}
