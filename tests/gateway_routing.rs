//! The gateway in front of three test workers: correctness under mixed load, and where
//! requests land.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use std::collections::HashMap;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_hundred_mixed_requests_all_succeed_with_the_right_content() {
    let (a, b, c) = (
        Worker::start(&[]).await,
        Worker::start(&[]).await,
        Worker::start(&[]).await,
    );
    let gw = Gateway::start(&[&a, &b, &c], "").await;
    let client = client();
    let mut tasks = tokio::task::JoinSet::new();
    let per_task = 500 / 16;
    for t in 0..16 {
        let (client, url) = (client.clone(), gw.url());
        let count = if t < 500 % 16 { per_task + 1 } else { per_task };
        tasks.spawn(async move {
            let mut seen = HashMap::<String, usize>::new();
            for i in 0..count {
                let content = format!("request {t} {i} says hello");
                let (path, body) = match i % 4 {
                    0 => ("/v1/chat/completions", chat(&content, false)),
                    1 => ("/v1/chat/completions", chat(&content, true)),
                    2 => ("/v1/completions", completion(&content, false)),
                    _ => ("/v1/completions", completion(&content, true)),
                };
                let answer = send(&client, &url, path, &body).await;
                assert_eq!(answer.status, 200, "{answer:?}");
                assert_eq!(answer.text, content, "wrong content for {path}");
                assert!(answer.done && !answer.stream_error);
                *seen.entry(answer.replica.unwrap()).or_default() += 1;
            }
            (count, seen)
        });
    }
    let mut total = 0;
    let mut per_replica = HashMap::<String, usize>::new();
    while let Some(r) = tasks.join_next().await {
        let (count, seen) = r.unwrap();
        total += count;
        for (k, v) in seen {
            *per_replica.entry(k).or_default() += v;
        }
    }
    assert_eq!(total, 500);
    assert_eq!(
        per_replica.len(),
        3,
        "distinct prompts use every replica: {per_replica:?}"
    );
    let metrics = gw.metrics().await;
    assert!(
        metrics.contains("kvgate_requests_total{replica=\""),
        "{metrics}"
    );
    assert!(metrics.contains("kvgate_routing_decision_seconds_count"));
    assert!(metrics.contains("kvgate_time_to_first_token_seconds_bucket"));
}

fn shared_prefix_prompt(i: usize) -> serde_json::Value {
    let system = "Shared system prompt with tools and rules. ".repeat(50); // ~2 KiB
    assert!(system.len() >= 2048);
    serde_json::json!({
        "model": MODEL,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": format!("question {i}")}],
        "max_tokens": 4,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_prefix_sticks_to_one_replica_until_it_is_saturated() {
    let (a, b, c) = (
        Worker::start(&[]).await,
        Worker::start(&[]).await,
        Worker::start(&[]).await,
    );
    let workers = [&a, &b, &c];
    // The bounded-load caps alone: with the hot-group rule, one prompt that all traffic shares
    // counts as held everywhere after a dozen requests and follows the traffic-bounded ring.
    let policy = format!("policy:\n{BOUNDED_LOAD}  hot_group_factor: 1000\n");
    let gw = Gateway::start(&[&a, &b, &c], &policy).await;
    let client = client();

    // One at a time: the owner is never over the load bound, so every request sticks.
    let mut owner = None;
    for i in 0..20 {
        let answer = send(
            &client,
            &gw.url(),
            "/v1/chat/completions",
            &shared_prefix_prompt(i),
        )
        .await;
        assert_eq!(answer.status, 200);
        let replica = answer.replica.unwrap();
        assert_eq!(
            owner.get_or_insert(replica.clone()),
            &replica,
            "request {i} left the prefix owner"
        );
    }
    let owner = owner.unwrap();

    // Slow every worker down and send 16 at once: the owner fills to its cap and the rest spill.
    for w in workers {
        w.set_faults(serde_json::json!({ "first_token_delay_ms": 800 }))
            .await;
    }
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..16 {
        let (client, url) = (client.clone(), gw.url());
        tasks.spawn(async move {
            let answer = send(
                &client,
                &url,
                "/v1/chat/completions",
                &shared_prefix_prompt(100 + i),
            )
            .await;
            assert_eq!(answer.status, 200);
            answer.replica.unwrap()
        });
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let mut landed = HashMap::<String, usize>::new();
    while let Some(r) = tasks.join_next().await {
        *landed.entry(r.unwrap()).or_default() += 1;
    }
    let on_owner = landed.get(&owner).copied().unwrap_or(0);
    // No cap is under `min_load_cap` (8): a batching engine with a few requests is not loaded.
    assert!(
        on_owner >= 8,
        "the owner takes what its bound allows: {landed:?}"
    );
    assert!(on_owner < 16, "a saturated owner must spill: {landed:?}");
    // Past its bounded-load cap the owner still has the least prefill ahead (it holds the
    // prompt), so only the imbalance guard stops it: 3 x (the idlest's in flight + 1) or a
    // whole-prompt holder's cap, whichever is more; with 16 requests on 3 replicas,
    // ceil(1.75 * 16 / 3) = 10 at most.
    assert!(
        on_owner <= 10,
        "the owner exceeded the imbalance guard: {landed:?}"
    );

    // Recovered: the prefix goes to a replica that holds it.
    for w in workers {
        w.set_faults(serde_json::json!({})).await;
    }
    let answer = send(
        &client,
        &gw.url(),
        "/v1/chat/completions",
        &shared_prefix_prompt(999),
    )
    .await;
    // To a replica holding it: the owner, or one it spilled to (of those, the one with the
    // least recent traffic, `traffic_bound`).
    let replica = answer.replica.unwrap();
    assert!(
        landed.contains_key(&replica),
        "{replica} holds no copy: {landed:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn distinct_cold_prefixes_spread_within_the_load_factor() {
    let slow = ["--first-token-delay-ms", "1000"];
    let (a, b, c) = (
        Worker::start(&slow).await,
        Worker::start(&slow).await,
        Worker::start(&slow).await,
    );
    let gw = Gateway::start(&[&a, &b, &c], &format!("policy:\n{BOUNDED_LOAD}")).await;
    let client = client();
    let mut tasks = tokio::task::JoinSet::new();
    let n = 30;
    for i in 0..n {
        let (client, url) = (client.clone(), gw.url());
        tasks.spawn(async move {
            let body = completion(&format!("{i} a distinct cold prompt number {i}"), false);
            let answer = send(&client, &url, "/v1/completions", &body).await;
            assert_eq!(answer.status, 200);
            answer.replica.unwrap()
        });
    }
    let mut landed = HashMap::<String, usize>::new();
    while let Some(r) = tasks.join_next().await {
        *landed.entry(r.unwrap()).or_default() += 1;
    }
    // All 30 are in flight together, so bounded load caps each replica at ceil(1.25 * 30 / 3).
    let cap = (1.25f64 * n as f64 / 3.0).ceil() as usize;
    assert_eq!(landed.len(), 3, "{landed:?}");
    assert!(
        landed.values().all(|&v| v <= cap),
        "a replica took more than {cap}: {landed:?}"
    );
}

/// A conversation keeps its replica: ten turns whose prompts share nothing (so neither prefix
/// nor ring would keep them together) stay on one replica when they name a session, by the
/// `x-session-id` header or the `user` field; without one they spread.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ten_turn_conversation_keeps_its_replica() {
    let (a, b, c) = (
        Worker::start(&[]).await,
        Worker::start(&[]).await,
        Worker::start(&[]).await,
    );
    let gw = Gateway::start(&[&a, &b, &c], "").await;
    let http = client();
    let prompt = |turn: usize| {
        completion(
            &format!("{turn} unrelated question number {}", turn * 7919),
            false,
        )
    };
    let mut spread = std::collections::HashSet::new();
    for turn in 0..10 {
        spread.insert(
            send(&http, &gw.url(), "/v1/completions", &prompt(turn))
                .await
                .replica,
        );
    }
    assert!(
        spread.len() >= 2,
        "without a session the turns spread: {spread:?}"
    );

    for (name, how) in [("conv-header", "header"), ("conv-user", "user")] {
        let mut replicas = Vec::new();
        for turn in 0..10 {
            let mut body = prompt(turn);
            let mut req = http
                .post(format!("{}/v1/completions", gw.url()))
                .header("x-kvgate-debug", "1");
            if how == "header" {
                req = req.header("x-session-id", name);
            } else {
                body["user"] = name.into();
            }
            let r = req.json(&body).send().await.unwrap();
            assert_eq!(r.status(), 200);
            replicas.push(
                r.headers()["x-kvgate-replica"]
                    .to_str()
                    .unwrap()
                    .to_string(),
            );
            let _ = r.bytes().await;
            // The user reads the answer before the next turn, and the gateway has let the last
            // request go: a replica holding one request while the others hold none is at the
            // load bound, where stickiness yields.
            gw.wait_until(|rs| rs.iter().all(|r| r["in_flight"] == 0))
                .await;
        }
        assert!(
            replicas.iter().all(|r| *r == replicas[0]),
            "{how}: {replicas:?}"
        );
    }
}

/// The prefill signal: a replica prefilling a long prompt is passed over by short cold prompts
/// even when the request counts are equal, and its backlog clears at the first token, not at
/// the end of the answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_prefill_steers_short_prompts_to_the_other_replica() {
    let slow = ["--first-token-delay-ms", "1500", "--token-delay-ms", "100"];
    let (a, b) = (Worker::start(&slow).await, Worker::start(&slow).await);
    let gw = Gateway::start(&[&a, &b], "").await;
    let client = client();
    let backlog = |r: &serde_json::Value| r["prefill_backlog"].as_u64().unwrap();

    // ~10,000 tokens at the gateway's text-mode estimate of 4 bytes a token.
    let long = {
        let mut body = chat(&"lorem ipsum ".repeat(3_400), true);
        body["max_tokens"] = 20.into();
        body
    };
    let (c, url) = (client.clone(), gw.url());
    let long_task =
        tokio::spawn(async move { send(&c, &url, "/v1/chat/completions", &long).await });
    gw.wait_until(|rs| rs.iter().any(|r| backlog(r) >= 9_000))
        .await;
    let replicas = gw.replicas().await;
    let busy = replicas.iter().find(|r| backlog(r) >= 9_000).unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();

    // Short, distinct, cold prompts, all in flight together: every one goes to the replica
    // with less prefill ahead, though after the first the request counts are equal and then
    // favour the busy one.
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..4 {
        let (c, url) = (client.clone(), gw.url());
        tasks.spawn(async move {
            let body = chat(
                &format!("short question number {i}, distinct: {}", i * 7919),
                true,
            );
            send(&c, &url, "/v1/chat/completions", &body).await
        });
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    while let Some(answer) = tasks.join_next().await {
        let answer = answer.unwrap();
        assert_eq!(answer.status, 200);
        assert_ne!(
            answer.replica.unwrap(),
            busy,
            "a short prompt queued behind the long one"
        );
    }

    // The long answer is still streaming, but its prompt is no longer queued prefill.
    gw.wait_until(|rs| {
        rs.iter()
            .any(|r| r["id"] == busy.as_str() && r["in_flight"] == 1 && backlog(r) == 0)
    })
    .await;
    let answer = long_task.await.unwrap();
    assert_eq!(answer.status, 200);
    assert!(answer.done);
    gw.wait_until(|rs| rs.iter().all(|r| r["in_flight"] == 0 && backlog(r) == 0))
        .await;
    let series = format!("kvgate_replica_prefill_backlog_tokens{{replica=\"{busy}\"}} 0\n");
    assert!(gw.metrics().await.contains(&series), "no `{series}`");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streaming_replica_is_timed_by_its_tokens_and_counts_idle_once_done() {
    let paced = ["--token-delay-ms", "150"];
    let (a, b) = (Worker::start(&paced).await, Worker::start(&paced).await);
    let gw = Gateway::start(&[&a, &b], "").await;
    let mut long = chat("a long answer, please", true);
    long["max_tokens"] = 16.into();
    let (c, url) = (client(), gw.url());
    let stream = tokio::spawn(async move { send(&c, &url, "/v1/chat/completions", &long).await });

    // Once its tokens have shown a step, the streaming replica's step under way is counted
    // ahead of a new request; the idle one's is not.
    let probe = chat("another question", false);
    let waits = until_explained(&gw, &probe, "step_wait", "a step under way", |c| {
        c.iter().any(|(_, w)| *w > 0.0)
    })
    .await;
    assert_eq!(
        waits.iter().filter(|(_, w)| *w > 0.0).count(),
        1,
        "{waits:?}"
    );

    let answer = stream.await.unwrap();
    assert_eq!((answer.status, answer.done), (200, true));
    // Nothing in flight: likely idle, so a request would start a step at once.
    until_explained(&gw, &probe, "step_wait", "no step counted", |c| {
        c.iter().all(|(_, w)| *w == 0.0)
    })
    .await;
}
