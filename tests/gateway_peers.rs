//! The decision exchange between gateway replicas (`peers:`), with real gateways and workers
//! on loopback: a prompt one gateway routed is known to the other as held where it went, the
//! prefill one gateway has queued counts in the other's ranking until its first token, the
//! exchange needs its token and a well-formed push, and a peer that is down costs nothing but
//! its pushes.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use std::time::{Duration, Instant};

const TOKEN: &str = "peer-test-token";

fn peers_yaml(token: &std::path::Path, peer_admin_ports: &[u16]) -> String {
    let urls: Vec<String> = peer_admin_ports
        .iter()
        .map(|p| format!("\"http://127.0.0.1:{p}\""))
        .collect();
    format!(
        "peers:\n  urls: [{}]\n  token_file: \"{}\"\n  interval_ms: 5\n",
        urls.join(", "),
        token.display()
    )
}

fn token_file(port: u16) -> tempfile::TempPath {
    temp_file_with(&format!("peer-token-{port}"), "", format!("{TOKEN}\n"))
}

/// A chat long enough for several prefix chunks, distinct per `n`.
fn long_chat(n: u32) -> serde_json::Value {
    chat(
        &format!("document {n}: {}", "lorem ipsum dolor sit amet ".repeat(60)),
        false,
    )
}

/// Each replica's prefix signal in `gw`'s explanation of `body`, by name.
async fn prefix_by_replica(gw: &Gateway, body: &serde_json::Value) -> Vec<(String, f64)> {
    by_replica(gw, body, "prefix_blocks").await
}

async fn push(gw: &Gateway, token: Option<&str>, body: &str) -> (u16, String) {
    let mut req = client()
        .post(format!("{}/peer/decisions", gw.admin()))
        .header("content-type", "application/json")
        .body(body.to_string());
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let r = req.send().await.unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_routed_by_one_gateway_is_known_to_the_other() {
    let workers = [
        Worker::start(&[]).await,
        Worker::start(&[]).await,
        Worker::start(&[]).await,
    ];
    let upstreams: Vec<&dyn Upstream> = workers.iter().map(|w| w as &dyn Upstream).collect();
    let (a_port, a_admin, b_port, b_admin) = (free_port(), free_port(), free_port(), free_port());
    let token = token_file(a_port);
    let a = Gateway::start_at(a_port, a_admin, &upstreams, &peers_yaml(&token, &[b_admin])).await;
    let b = Gateway::start_at(b_port, b_admin, &upstreams, &peers_yaml(&token, &[a_admin])).await;
    let http = client();
    for n in 0..3 {
        let body = long_chat(n);
        let before = prefix_by_replica(&b, &body).await;
        assert!(before.iter().all(|(_, p)| *p == 0.0), "{before:?}");
        let answer = send(&http, &a.url(), "/v1/chat/completions", &body).await;
        assert_eq!(answer.status, 200);
        let chosen = answer.replica.unwrap();
        // B learns where A sent it within a few pushes.
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let now = prefix_by_replica(&b, &body).await;
            let held: Vec<&str> = now
                .iter()
                .filter(|(_, p)| *p > 0.0)
                .map(|(r, _)| r.as_str())
                .collect();
            if held == [chosen.as_str()] {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "B never learnt that {chosen} holds document {n}: {now:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let m = a.metrics().await;
    assert!(
        metric(&m, "kvgate_peer_decisions_total{outcome=\"sent\"}") >= 3.0,
        "{m}"
    );
    let m = b.metrics().await;
    assert!(
        metric(&m, "kvgate_peer_decisions_total{outcome=\"received\"}") >= 3.0,
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_needs_the_token_and_a_well_formed_body() {
    let worker = Worker::start(&[]).await;
    let port = free_port();
    let token = token_file(port);
    // Its peer is a port nobody listens on.
    let gw = Gateway::start_at(
        port,
        free_port(),
        &[&worker],
        &peers_yaml(&token, &[free_port()]),
    )
    .await;
    let ok = format!(
        r#"{{"version":1,"decisions":[{{"replica":"{}","chunks":[1,2,3]}}]}}"#,
        worker.id()
    );
    assert_eq!(push(&gw, None, &ok).await.0, 401);
    assert_eq!(push(&gw, Some("wrong"), &ok).await.0, 401);
    assert_eq!(push(&gw, Some(TOKEN), "{not json").await.0, 400);
    let (status, body) = push(&gw, Some(TOKEN), r#"{"version":3,"decisions":[]}"#).await;
    assert_eq!(status, 400);
    assert!(body.contains("version 3"), "{body}");
    let unknown = r#"{"version":1,"decisions":[{"replica":"nobody","chunks":[1]}]}"#;
    assert_eq!(push(&gw, Some(TOKEN), unknown).await.0, 200);
    assert_eq!(push(&gw, Some(TOKEN), &ok).await.0, 200);
    let m = gw.metrics().await;
    assert_eq!(
        metric(
            &m,
            "kvgate_peer_decisions_total{outcome=\"unknown_replica\"}"
        ),
        1.0
    );
    assert_eq!(
        metric(&m, "kvgate_peer_decisions_total{outcome=\"received\"}"),
        1.0
    );
    assert_eq!(
        metric(&m, "kvgate_peer_decisions_total{outcome=\"rejected\"}"),
        4.0
    );
    // The dead peer: requests are served, its pushes fail and their decisions are lost.
    let http = client();
    for n in 0..3 {
        let answer = send(&http, &gw.url(), "/v1/chat/completions", &long_chat(n)).await;
        assert_eq!(answer.status, 200);
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let m = gw.metrics().await;
        if metric(&m, "kvgate_peer_decisions_total{outcome=\"lost\"}") >= 3.0 {
            break;
        }
        assert!(Instant::now() < deadline, "no failed push counted: {m}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peers_backlog_counts_until_its_first_token() {
    // Slow first tokens keep A's request in its backlog long enough to watch.
    let slow = ["--first-token-delay-ms", "1500"];
    let workers = [Worker::start(&slow).await, Worker::start(&slow).await];
    let upstreams: Vec<&dyn Upstream> = workers.iter().map(|w| w as &dyn Upstream).collect();
    let (a_port, a_admin, b_port, b_admin) = (free_port(), free_port(), free_port(), free_port());
    let token = token_file(a_port);
    let a = Gateway::start_at(a_port, a_admin, &upstreams, &peers_yaml(&token, &[b_admin])).await;
    let b = Gateway::start_at(b_port, b_admin, &upstreams, &peers_yaml(&token, &[a_admin])).await;
    let body = long_chat(1);
    let (url, sent) = (a.url(), body.clone());
    let request =
        tokio::spawn(async move { send(&client(), &url, "/v1/chat/completions", &sent).await });
    // B counts A's prompt on the replica A chose, and on that one only.
    let queued = until_explained(&b, &body, "prefill_backlog", "saw A's backlog", |c| {
        c.iter().any(|(_, t)| *t > 0.0)
    })
    .await;
    let on: Vec<&str> = queued
        .iter()
        .filter(|(_, t)| *t > 0.0)
        .map(|(r, _)| r.as_str())
        .collect();
    let answer = request.await.unwrap();
    assert_eq!(answer.status, 200);
    assert_eq!(on, [answer.replica.unwrap().as_str()], "{queued:?}");
    // Its first token came: the next push says so.
    until_explained(&b, &body, "prefill_backlog", "saw A's backlog drain", |c| {
        c.iter().all(|(_, t)| *t == 0.0)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pushed_backlog_replaces_the_last_and_needs_a_sender() {
    let workers = [Worker::start(&[]).await, Worker::start(&[]).await];
    let upstreams: Vec<&dyn Upstream> = workers.iter().map(|w| w as &dyn Upstream).collect();
    let port = free_port();
    let token = token_file(port);
    let gw = Gateway::start_at(
        port,
        free_port(),
        &upstreams,
        &peers_yaml(&token, &[free_port()]),
    )
    .await;
    let (w0, w1) = (workers[0].id(), workers[1].id());
    let body = long_chat(2);
    let backlog = |by: &str, tokens: &[(&str, u64)]| {
        let entries: Vec<String> = tokens
            .iter()
            .map(|(r, t)| format!(r#"{{"replica":"{r}","tokens":{t}}}"#))
            .collect();
        format!(
            r#"{{"version":2,{by}"decisions":[],"backlog":[{}]}}"#,
            entries.join(",")
        )
    };
    let push_ok = |text: String| {
        let gw = &gw;
        async move { assert_eq!(push(gw, Some(TOKEN), &text).await.0, 200, "{text}") }
    };
    let sender = r#""gateway":11,"#;
    push_ok(backlog(sender, &[(&w0, 900_000), ("nobody", 5)])).await;
    let ranked = by_replica(&gw, &body, "prefill_backlog").await;
    assert_eq!(ranked, [(w1.clone(), 0.0), (w0.clone(), 900_000.0)]);
    // Its next word replaces the last; another peer's adds to it.
    push_ok(backlog(sender, &[(&w1, 800_000)])).await;
    push_ok(backlog(r#""gateway":12,"#, &[(&w1, 1)])).await;
    let ranked = by_replica(&gw, &body, "prefill_backlog").await;
    assert_eq!(ranked, [(w0.clone(), 0.0), (w1.clone(), 800_001.0)]);
    // A backlog without a sender cannot be replaced later: it is not taken.
    push_ok(backlog("", &[(&w0, 9_000_000)])).await;
    let ranked = by_replica(&gw, &body, "prefill_backlog").await;
    assert_eq!(ranked[0], (w0.clone(), 0.0));
    let bad =
        r#"{"version":2,"gateway":11,"decisions":[],"backlog":[{"replica":"x","tokens":-1}]}"#;
    assert_eq!(push(&gw, Some(TOKEN), bad).await.0, 400);
}
