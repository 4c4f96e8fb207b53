//! Near-ties among replicas holding as much of the prompt (`tie_margin`): the request's draw
//! picks one, so that gateways sharing no decisions do not all send to the same replica; a
//! prompt no replica holds keeps the ring's order, so that gateways agree where it goes.

use super::*;
use std::collections::BTreeSet;

fn with_margin(margin: f64) -> Policy {
    policy_with(
        4,
        PolicyConfig {
            tie_margin: margin,
            ..Default::default()
        },
    )
}

fn drawn(f: &RequestFeatures, draw: u64) -> RequestFeatures {
    RequestFeatures {
        tie_draw: draw,
        ..f.clone()
    }
}

#[test]
fn a_tie_among_equal_holders_goes_where_the_draw_says() {
    let f = features(9, &[1, 2, 3]);
    let fleet = view(&[1, 1, 1, 1]);
    for (margin, spread) in [(0.02, 4), (0.0, 1)] {
        let mut p = with_margin(margin);
        for r in 0..4 {
            p.record(ReplicaId(r), &f);
        }
        let firsts: BTreeSet<ReplicaId> = (0..4)
            .map(|draw| {
                let d = p.select(&drawn(&f, draw), FleetView { replicas: &fleet });
                assert_eq!(d.tied, spread, "{margin}");
                d.ranked[0].replica
            })
            .collect();
        assert_eq!(firsts.len(), spread as usize, "{margin}");
    }
}

#[test]
fn a_prompt_no_replica_holds_keeps_the_ring_order_whatever_the_draw() {
    let p = with_margin(0.5);
    let fleet = view(&[1, 1, 1, 1]);
    let f = features(9, &[1, 2, 3]);
    let owner = p.select(&f, FleetView { replicas: &fleet }).ranked[0].replica;
    for draw in 0..16 {
        let d = p.select(&drawn(&f, draw), FleetView { replicas: &fleet });
        assert_eq!((d.ranked[0].replica, d.tied), (owner, 1));
    }
}

proptest! {
    /// Whatever the fleet and the draw, the draw only reorders what is tied: the first is
    /// within the margin of the best total and holds at least as much of the prompt, a prompt
    /// the best does not hold keeps the best first, and the rest keep their order.
    #[test]
    fn a_draw_moves_only_an_equal_holder_within_the_margin(
        loads in prop::collection::vec(0u32..6, 4),
        kv in prop::collection::vec(0.0f64..1.0, 4),
        held in prop::collection::vec(0usize..4, 4),
        margin in 0.0f64..0.5,
        draw: u64,
    ) {
        let mut p = with_margin(margin);
        let chunks = [1, 2, 3];
        for (r, &h) in held.iter().enumerate() {
            if h > 0 {
                p.record(ReplicaId(r as u32), &features(100 + r as u64, &chunks[..h]));
            }
        }
        let mut fleet = view(&loads);
        for (r, &u) in fleet.iter_mut().zip(&kv) {
            r.kv_usage = Some(u);
        }
        let f = features(9, &chunks);
        let plain = p.select(&f, FleetView { replicas: &fleet });
        let d = p.select(&drawn(&f, draw), FleetView { replicas: &fleet });
        let (best, first) = (plain.ranked[0], d.ranked[0]);
        prop_assert!(first.total >= best.total - margin);
        prop_assert!(first.prefix_blocks >= best.prefix_blocks);
        if best.prefix_blocks == 0.0 {
            prop_assert_eq!(first.replica, best.replica);
        }
        let rest: Vec<ReplicaId> = plain.ranked.iter().map(|c| c.replica).filter(|&r| r != first.replica).collect();
        let drawn_rest: Vec<ReplicaId> = d.ranked[1..].iter().map(|c| c.replica).collect();
        prop_assert_eq!(rest, drawn_rest);
    }
}
