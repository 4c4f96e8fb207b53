//! Wire behaviour: unbuffered streaming, h2c clients, request ids, models, explain.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sse_passes_through_unbuffered() {
    let w = Worker::start(&["--token-delay-ms", "300"]).await;
    let gw = Gateway::start(&[&w], "").await;
    let mut resp = client()
        .post(format!("{}/v1/completions", gw.url()))
        .json(&completion("one two three four five", true))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let first = resp.chunk().await.unwrap().unwrap();
    let (text, _, done) = parse_sse(&String::from_utf8_lossy(&first));
    // The first token arrives on its own, while the worker is still generating the rest.
    assert_eq!(text, "one ");
    assert!(!done);
    assert_eq!(w.stats().await["completed"], 0);
    let mut rest = Vec::new();
    while let Some(c) = resp.chunk().await.unwrap() {
        rest.extend_from_slice(&c);
    }
    let (text, _, done) = parse_sse(&String::from_utf8_lossy(&rest));
    assert_eq!(text, "two three four five");
    assert!(done);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2c_clients_are_served() {
    let w = Worker::start(&[]).await;
    let gw = Gateway::start(&[&w], "").await;
    let body = serde_json::to_string(&chat("over http two", false)).unwrap();
    let out = tokio::process::Command::new("curl")
        .args([
            "-s",
            "--http2-prior-knowledge",
            "-H",
            "content-type: application/json",
            "-d",
            &body,
        ])
        .arg(format!("{}/v1/chat/completions", gw.url()))
        .output()
        .await
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "over http two");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_ids_models_and_explain() {
    let (a, b) = (
        Worker::start(&[]).await,
        Worker::start(&["--model", "other-model"]).await,
    );
    let gw = Gateway::start(&[&a, &b], "").await;
    let client = client();

    let resp = client
        .post(format!("{}/v1/completions", gw.url()))
        .header("x-request-id", "my-id-42")
        .json(&completion("x", false))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.headers()["x-request-id"], "my-id-42");
    assert!(
        !resp.headers().contains_key("x-kvgate-route"),
        "explanations are opt-in"
    );
    let resp = client
        .post(format!("{}/v1/completions", gw.url()))
        .json(&completion("y", false))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.headers()["x-request-id"].len(), 24, "a generated id");
    // Opted in: the chosen replica's whole breakdown, every signal by name; the metrics and
    // the admin API carry the same.
    let resp = client
        .post(format!("{}/v1/completions", gw.url()))
        .header("x-kvgate-debug", "1")
        .json(&completion("z", false))
        .send()
        .await
        .unwrap();
    let route = resp.headers()["x-kvgate-route"]
        .to_str()
        .unwrap()
        .to_string();
    let replica = resp.headers()["x-kvgate-replica"]
        .to_str()
        .unwrap()
        .to_string();
    let metrics = gw.metrics().await;
    let row = gw
        .replicas()
        .await
        .into_iter()
        .find(|r| r["id"] == replica.as_str())
        .unwrap();
    for signal in [
        "prefix", "ring", "load", "prefill", "fresh", "session", "kv", "adapter", "spread",
    ] {
        assert!(
            route.contains(&format!(";{signal}=")),
            "{signal} missing: {route}"
        );
        assert!(
            metrics.contains(&format!(
                "kvgate_replica_last_score{{replica=\"{replica}\",signal=\"{signal}\"}}"
            )),
            "{signal} missing from the metrics"
        );
        assert!(row["last_scores"]["signals"][signal].is_number(), "{row}");
    }

    let models = get_json(&format!("{}/v1/models", gw.url())).await;
    let mut ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    ids.sort();
    assert_eq!(ids, ["other-model", "test-model"]);
    // Each model goes only to the replica that serves it.
    let mut body = completion("for the other model", false);
    body["model"] = "other-model".into();
    assert_eq!(
        send(&client, &gw.url(), "/v1/completions", &body)
            .await
            .replica
            .unwrap(),
        b.id()
    );

    let before = a.stats().await["requests"].clone();
    let explained: serde_json::Value = client
        .post(format!("{}/admin/explain", gw.admin()))
        .json(&chat("explain me", false))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let candidates = explained["candidates"].as_array().unwrap();
    assert_eq!(
        candidates.len(),
        1,
        "only the test-model replica: {explained}"
    );
    assert_eq!(candidates[0]["replica"], a.id());
    assert!(candidates[0]["score"]["signals"]["ring"].is_number());
    assert_eq!(a.stats().await["requests"], before, "explain sends nothing");
}
