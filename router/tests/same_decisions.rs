//! The gateway is an I/O shell around `FleetState`: driven with the same events, the gateway
//! and a bare fleet state (as the simulator keeps one per gateway) rank alike, request after
//! request, while requests start, reach their first token and end in between.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvgate_policies::{Ask, FleetState, ReplicaId, ReplicaSpec, RequestFeatures};
use kvgate_protocol::{text_chunk_hashes, HashSeed};
use kvgate_router::Gateway;
use std::collections::BTreeMap;

const REPLICAS: u32 = 5;

fn features(i: usize) -> RequestFeatures {
    // Eight system prompts, each with questions of its own.
    let text = format!(
        "{} question {i}",
        format!("system prompt {} ", i % 8).repeat(40)
    );
    let chunks = text_chunk_hashes(HashSeed::new("m", None, ""), text.as_bytes(), 256);
    RequestFeatures {
        ring_key: chunks[chunks.len().min(4) - 1],
        prompt_tokens: text.len() as u64 / 4,
        prefix_chunks: chunks,
        now_ms: i as u64,
        ..Default::default()
    }
}

#[test]
fn the_gateway_and_a_bare_fleet_state_rank_alike() {
    let replicas: String = (0..REPLICAS)
        .map(|i| {
            format!(
                "  - url: \"http://127.0.0.1:{}\"\n    models: [m]\n",
                9100 + i
            )
        })
        .collect();
    let config = kvgate_router::config::parse_str(&format!(
        "listen: \"127.0.0.1:1\"\nreplicas:\n{replicas}"
    ))
    .unwrap();
    let gateway = Gateway::new(config.clone(), None).unwrap();
    let mut fleet = FleetState::new(config.policy.clone(), None);
    fleet.set_replicas(
        (0..REPLICAS)
            .map(|i| {
                let url = format!("http://127.0.0.1:{}", 9100 + i);
                let spec = ReplicaSpec {
                    name: url.clone(),
                    url,
                    models: vec!["m".into()],
                    labels: BTreeMap::new(),
                    max_in_flight: None,
                };
                (ReplicaId(i), spec)
            })
            .collect(),
    );
    let snap = gateway.snapshot();
    let pool = BTreeMap::new();
    let mut held = Vec::new();
    for i in 0..300 {
        let f = features(i);
        let mut route = gateway.route(&snap, "m", &f, None).unwrap();
        let ask = Ask {
            model: "m",
            pool: &pool,
            features: &f,
        };
        let decision = fleet.route(i as u64, &ask, 0, 3).unwrap();
        let gateway_ranking: Vec<(u32, u64)> = route
            .ranked
            .iter()
            .map(|(r, c)| (r.slot.0, c.total.to_bits()))
            .collect();
        let fleet_ranking: Vec<(u32, u64)> = decision
            .ranked
            .iter()
            .map(|c| (c.replica.0, c.total.to_bits()))
            .collect();
        assert_eq!(gateway_ranking, fleet_ranking, "request {i}");
        // Some get their first token, some stay in flight, the rest end.
        if i % 2 == 0 {
            route.first.prefilled(i as u64 + 1);
            fleet.first_token(i as u64, i as u64 + 1);
        }
        if i % 3 == 0 {
            held.push((i, route));
        } else {
            drop(route);
            fleet.finished(i as u64);
        }
        if held.len() > 20 {
            let (j, old) = held.remove(0);
            drop(old);
            fleet.finished(j as u64);
        }
    }
}

/// A routed request's draw for a tie (`tie_margin`) is its own, and a second gateway process
/// draws apart from the first: gateways sharing no decisions break their ties independently.
#[test]
fn each_request_and_each_gateway_draws_its_own_tie_break() {
    let config = kvgate_router::config::parse_str(
        "listen: \"127.0.0.1:1\"\nreplicas:\n  - url: \"http://127.0.0.1:9100\"\n",
    )
    .unwrap();
    let (a, b) = (
        Gateway::new(config.clone(), None).unwrap(),
        Gateway::new(config, None).unwrap(),
    );
    let from_a: Vec<u64> = (0..1_000).map(|_| a.tie_draw()).collect();
    let from_b: Vec<u64> = (0..1_000).map(|_| b.tie_draw()).collect();
    let distinct: std::collections::BTreeSet<u64> = from_a.iter().chain(&from_b).copied().collect();
    assert_eq!(distinct.len(), 2_000);
    // Uniform enough that a tie of two splits about evenly.
    let odd = from_a.iter().filter(|d| *d % 2 == 1).count();
    assert!((400..600).contains(&odd), "{odd}");
}
