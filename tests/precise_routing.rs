//! Token mode end to end: four sim workers, each with an agent relaying its KV events, behind
//! a gateway that tokenizes prompts with the model's GGUF and hashes them as the workers do.
//! With 20 shared-prefix groups, each group's requests go to the replica that holds its blocks
//! (known from events, not from the gateway's own guesses, which expire first). Over its
//! bounded-load cap a holder keeps its group (it has the least to prefill); at a hard limit
//! (the imbalance guard, or queueing as its agent reports) the group spills, and it returns
//! when the holder recovers.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use std::time::{Duration, Instant};

const TOKEN: &str = "precise-test-token";
const GROUPS: usize = 20;
const ROUNDS: usize = 5;

fn system_prompt(group: usize) -> String {
    let topics = ["invoices", "shipping", "returns", "accounts", "gift cards"];
    format!(
        "You are assistant number {group} of the shop. You answer questions about {} only. {}",
        topics[group % topics.len()],
        format!("Rule {group}: be brief, be kind, cite the policy section of group {group}. ")
            .repeat(8)
    )
}

fn ask(group: usize, question: usize, max_tokens: u32) -> serde_json::Value {
    serde_json::json!({
        "model": MODEL,
        "max_tokens": max_tokens,
        "messages": [
            {"role": "system", "content": system_prompt(group)},
            {"role": "user", "content": format!("Question {question}: where is my parcel?")},
        ],
    })
}

/// Starts a long request of group 0 through the gateway and waits until `home` has `n` in
/// flight: it must have gone there.
async fn start_long(gw: &Gateway, home: &str, n: u64) -> tokio::task::JoinHandle<Answer> {
    let mut body = ask(0, 100 + n as usize * 10, 3000);
    body["ignore_eos"] = true.into();
    let url = gw.url();
    let task =
        tokio::spawn(async move { send(&client(), &url, "/v1/chat/completions", &body).await });
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let rs = gw.replicas().await;
        if rs.iter().any(|r| r["id"] == home && r["in_flight"] == n) {
            return task;
        }
        assert!(
            Instant::now() < deadline,
            "long request {n} did not start on {home}: {rs:#?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Sends a chat request and waits until the gateway has let it go (a request still counted
/// in flight can tip its replica over the load bound, where stickiness yields).
async fn settled(gw: &Gateway, body: &serde_json::Value) -> String {
    let a = send(&client(), &gw.url(), "/v1/chat/completions", body).await;
    assert_eq!(a.status, 200, "{a:?}");
    gw.wait_until(|rs| rs.iter().all(|r| r["in_flight"] == 0))
        .await;
    a.replica.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn groups_stay_where_their_blocks_are() {
    let mut workers = Vec::new();
    // Two sequences at a time: direct traffic can make a worker queue.
    for _ in 0..4 {
        workers.push(SimWorker::start(&["--time-scale", "0.05", "--max-num-seqs", "2"]).await);
    }
    let token = temp_file_with("precise-token", "", TOKEN);
    let model = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    // Guesses expire after 300 ms: later decisions rest on the workers' events alone. The
    // bounded-load caps on (the default has them off) without a floor, so that three long
    // requests reach the imbalance guard.
    let yaml = format!(
        "agents:\n  token_file: \"{}\"\ntokenizers:\n  - model: {MODEL}\n    path: \"{}\"\n    block_size: 16\npolicy:\n{BOUNDED_LOAD}  assumed_ttl_ms: 300\n  queue_saturation: 2\n  min_load_cap: 1\n",
        token.display(),
        model.display()
    );
    let upstreams: Vec<&dyn Upstream> = workers.iter().map(|w| w as &dyn Upstream).collect();
    let gw = Gateway::start(&upstreams, &yaml).await;
    let _agents: Vec<Proc> = workers
        .iter()
        .map(|w| attach_agent(&gw, &token, w, &[]))
        .collect();
    gw.wait_until(|rs| rs.iter().all(|r| r["freshness"] == "fresh"))
        .await;

    // Each group's first request places its blocks.
    let mut home = Vec::new();
    for g in 0..GROUPS {
        home.push(settled(&gw, &ask(g, 0, 4)).await);
    }
    let spread: std::collections::BTreeSet<&String> = home.iter().collect();
    assert!(spread.len() >= 3, "groups spread over the fleet: {home:?}");
    tokio::time::sleep(Duration::from_millis(800)).await;
    let metrics = gw.metrics().await;
    assert!(
        metric(
            &metrics,
            "kvgate_kv_event_batches_total{result=\"applied\"}"
        ) > 0.0,
        "{metrics}"
    );

    // A new question of group 0: its home holds the system prompt's blocks, by events alone.
    let e = gw.explain(&ask(0, 99, 4)).await;
    assert!(
        e["hot_group"].is_boolean(),
        "explain says whether the group is hot: {e:#}"
    );
    assert_eq!(
        e["tied"], 1,
        "one replica holds the prompt: no tie to draw from: {e:#}"
    );
    for c in e["candidates"].as_array().unwrap() {
        let prefix = c["score"]["signals"]["prefix"].as_f64().unwrap();
        if c["replica"] == home[0].as_str() {
            assert!(prefix > 0.8, "the home holds most blocks: {e:#}");
        } else {
            assert_eq!(prefix, 0.0, "no other replica does: {e:#}");
        }
    }
    assert_eq!(e["opens_session"], false, "no session: {e:#}");
    // The same question opening a session (`user`): it will return where it lands, so what
    // the group's holder has counts as held everywhere.
    let mut opening = ask(0, 99, 4);
    opening["user"] = "a-new-session".into();
    let e = gw.explain(&opening).await;
    assert_eq!(e["opens_session"], true, "{e:#}");
    let prefixes: Vec<f64> = e["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["score"]["signals"]["prefix"].as_f64().unwrap())
        .collect();
    assert!(
        prefixes.iter().all(|&p| p > 0.8 && p == prefixes[0]),
        "every replica counts the holder's blocks: {e:#}"
    );

    let (mut hits, mut total) = (0, 0);
    for round in 1..=ROUNDS {
        for (g, home) in home.iter().enumerate() {
            total += 1;
            if settled(&gw, &ask(g, round, 4)).await == *home {
                hits += 1;
            }
        }
    }
    let locality = f64::from(hits) / f64::from(total);
    println!("locality: {hits}/{total} = {locality:.3}");
    assert!(locality >= 0.95, "locality {hits}/{total}");

    // One long request on group 0's home puts it over its bounded-load cap, but the group
    // stays: the home has a few tokens to prefill where any other replica has the whole
    // prompt. At the imbalance guard (3 in flight while the others idle) the group spills;
    // when the long requests finish, it returns.
    let mut long = Vec::new();
    long.push(start_long(&gw, &home[0], 1).await);
    assert_eq!(
        send(
            &client(),
            &gw.url(),
            "/v1/chat/completions",
            &ask(0, 101, 4)
        )
        .await
        .replica
        .as_ref(),
        Some(&home[0]),
        "over the cap, the home still has the least to prefill"
    );
    for n in 2..=3 {
        long.push(start_long(&gw, &home[0], n).await);
    }
    let spilled = send(
        &client(),
        &gw.url(),
        "/v1/chat/completions",
        &ask(0, 102, 4),
    )
    .await;
    assert_ne!(
        spilled.replica.as_ref(),
        Some(&home[0]),
        "a home at the imbalance guard is passed over"
    );
    for l in long {
        l.abort();
    }
    gw.wait_until(|rs| rs.iter().all(|r| r["in_flight"] == 0))
        .await;
    // Recovered, the group stays where its blocks are: its home, or the replica it spilled
    // to (of two holders, the one with less recent traffic, `traffic_bound`).
    let back = settled(&gw, &ask(0, 103, 4)).await;
    assert!(
        back == home[0] || Some(&back) == spilled.replica.as_ref(),
        "recovered, the group went to {back}, neither its home {} nor {:?}",
        home[0],
        spilled.replica
    );
    let first_spill = spilled;

    // Traffic from elsewhere makes group 0's home queue: once its agent reports the queue at
    // the saturation threshold, the group spills; when the queue drains, it returns.
    let home_url = workers
        .iter()
        .find(|w| Upstream::id(*w) == home[0])
        .unwrap()
        .url();
    let direct: Vec<_> = (0..10)
        .map(|i| {
            let url = home_url.clone();
            tokio::spawn(async move {
                let body = serde_json::json!({
                    "model": MODEL, "prompt": format!("elsewhere {i}"), "max_tokens": 3000, "ignore_eos": true,
                });
                let r = client().post(format!("{url}/v1/completions")).json(&body).send().await;
                r.map(|r| r.status().as_u16()).unwrap_or(0)
            })
        })
        .collect();
    gw.wait_until(|rs| {
        rs.iter()
            .any(|r| r["id"] == home[0].as_str() && r["agent"]["waiting"].as_u64() >= Some(2))
    })
    .await;
    let spilled = send(
        &client(),
        &gw.url(),
        "/v1/chat/completions",
        &ask(0, 104, 4),
    )
    .await;
    assert_ne!(
        spilled.replica.as_ref(),
        Some(&home[0]),
        "a queueing home is passed over"
    );
    for d in direct {
        assert_eq!(d.await.unwrap(), 200);
    }
    gw.wait_until(|rs| {
        rs.iter().any(|r| {
            r["id"] == home[0].as_str() && r["agent"]["waiting"] == 0 && r["agent"]["running"] == 0
        })
    })
    .await;
    // Drained, the group again goes where its blocks are: its home or a replica it spilled to.
    let back = settled(&gw, &ask(0, 105, 4)).await;
    let holders = [
        Some(&home[0]),
        first_spill.replica.as_ref(),
        spilled.replica.as_ref(),
    ];
    assert!(
        holders.contains(&Some(&back)),
        "drained, the group went to {back}, none of {holders:?}"
    );
}
