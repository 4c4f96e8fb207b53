//! The rest of a replica's engine step under way (`ReplicaView::step_wait`): among replicas
//! with the same work ahead, the one whose step ends first is first; it never outweighs a
//! prompt the others would have to compute, nor moves a session's turn.

use super::*;

/// A 1,088-token prompt of 17 chunks (a system prompt and a question).
fn prompt() -> RequestFeatures {
    RequestFeatures {
        prompt_tokens: 1_088,
        ..features(9, &(1..=17).collect::<Vec<u64>>())
    }
}

fn waiting(waits: &[u64]) -> Vec<ReplicaView> {
    let mut fleet = view(&vec![3; waits.len()]);
    for (r, &w) in fleet.iter_mut().zip(waits) {
        r.step_wait = w;
    }
    fleet
}

#[test]
fn among_equal_holders_the_replica_whose_step_ends_first_is_first() {
    let mut p = policy_with(3, PolicyConfig::default());
    let f = prompt();
    for r in 0..3 {
        p.record(ReplicaId(r), &f);
    }
    for (waits, first) in [([40, 5, 30], 1), ([0, 25, 30], 0), ([30, 40, 2], 2)] {
        let d = p.select(
            &f,
            FleetView {
                replicas: &waiting(&waits),
            },
        );
        assert_eq!(d.ranked[0].replica, ReplicaId(first), "{waits:?}");
        let wait = waits[first as usize];
        assert_eq!(d.ranked[0].step_wait, wait);
        assert!(d.ranked[0]
            .breakdown()
            .contains(&format!(";step_wait={wait};")));
    }
}

#[test]
fn a_step_under_way_does_not_outweigh_the_prompt_held() {
    let mut p = policy_with(2, PolicyConfig::default());
    let f = prompt();
    p.record(ReplicaId(0), &f);
    // The holder is a whole step from its next one, the other about to start one.
    let d = p.select(
        &f,
        FleetView {
            replicas: &waiting(&[60, 0]),
        },
    );
    assert_eq!(d.ranked[0].replica, ReplicaId(0));
}

#[test]
fn a_sessions_turn_is_not_moved_off_its_home_for_a_step() {
    // The home holds 8 of the turn's 10 chunks (200 tokens to compute there, 1,000 elsewhere,
    // a session's recompute unpenalised), and is 900 tokens' worth of step from its next one:
    // counted, the step would send the turn away and its history would be computed again.
    let turn = |chunks: &[u64]| RequestFeatures {
        session: Some(42),
        prompt_tokens: 100 * chunks.len() as u64,
        ..features(7, chunks)
    };
    let mut p = policy_with(4, PolicyConfig::default());
    p.record(ReplicaId(0), &turn(&(1..=8).collect::<Vec<u64>>()));
    let d = p.select(
        &turn(&(1..=10).collect::<Vec<u64>>()),
        FleetView {
            replicas: &waiting(&[900, 0, 0, 0]),
        },
    );
    assert_eq!(d.ranked[0].replica, ReplicaId(0), "{d:?}");
    assert_eq!(d.ranked[0].step_wait, 0);
}
