//! Session stickiness: what it adds beyond what the prefix index shows the home holding.

use super::*;

/// A session's turn of `chunks`, 100 tokens a chunk.
fn turn(chunks: &[u64]) -> RequestFeatures {
    RequestFeatures {
        session: Some(42),
        prompt_tokens: 100 * chunks.len() as u64,
        ..features(7, chunks)
    }
}

/// Four replicas, equally loaded, with `backlog` prefill tokens queued at replica 0.
fn busy_home(backlog: u64) -> Vec<ReplicaView> {
    let mut fleet = view(&[1, 1, 1, 1]);
    fleet[0].prefill_backlog = backlog;
    fleet
}

#[test]
fn a_sessions_history_on_its_home_is_weighed_as_a_cached_prefix_and_not_again() {
    let history: Vec<u64> = (1..=8).collect();
    // The default without the spread signal: where new groups go is not at stake here.
    let mut config = PolicyConfig::default();
    config.weights.0[Signal::Spread] = 0.0;
    let mut p = policy_with(4, config);
    p.record(ReplicaId(0), &turn(&history));
    let next: Vec<u64> = (1..=10).collect();
    let unrelated: Vec<u64> = (50..60).collect();

    // Idle: the home, holding 8 of the next turn's 10 chunks; stickiness adds the other 2.
    let idle = busy_home(0);
    let d = p.select(&turn(&next), FleetView { replicas: &idle });
    assert_eq!(d.ranked[0].replica, ReplicaId(0));
    let home = d.ranked[0].signals;
    assert!((home[Signal::Session] - 0.2).abs() < 1e-9, "{home:?}");
    let d = p.select(&turn(&unrelated), FleetView { replicas: &idle });
    assert_eq!(d.ranked[0].signals[Signal::Session], 1.0);

    // 5,000 tokens queued at home: the next turn computes 200 there, 1,000 elsewhere, so
    // it moves, as a prompt with that much cached would; a prompt the index cannot place
    // follows the session.
    let busy = busy_home(5_000);
    let d = p.select(&turn(&next), FleetView { replicas: &busy });
    assert_ne!(d.ranked[0].replica, ReplicaId(0), "{d:?}");
    let d = p.select(&turn(&unrelated), FleetView { replicas: &busy });
    assert_eq!(d.ranked[0].replica, ReplicaId(0), "{d:?}");
}
