//! The gateway under bad input and failing workers.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use std::time::{Duration, Instant};

fn body_of_size(bytes: usize) -> Vec<u8> {
    let filler = "x".repeat(bytes);
    let body = serde_json::json!({"model": MODEL, "messages": [{"role": "user", "content": filler}], "max_tokens": 1});
    serde_json::to_vec(&body).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_bodies_arrive_byte_exact_and_oversized_ones_get_413() {
    let w = Worker::start(&[]).await;
    let gw = Gateway::start(&[&w], "").await;
    let client = client();
    for size in [2 << 20, 16 << 20] {
        let body = body_of_size(size);
        let expected = format!("{:032x}", xxhash_rust::xxh3::xxh3_128(&body));
        let resp = client
            .post(format!("{}/v1/chat/completions", gw.url()))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(
            resp.headers()["x-body-digest"].to_str().unwrap(),
            expected,
            "{size}-byte body altered"
        );
    }
    let resp = client
        .post(format!("{}/v1/chat/completions", gw.url()))
        .body(body_of_size(33 << 20))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 413);
    let err: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(err["error"]["code"], "payload_too_large");
    assert_eq!(
        w.stats().await["requests"],
        2,
        "the oversized body must not reach the worker"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curl_with_expect_continue_is_not_stalled() {
    let w = Worker::start(&[]).await;
    let gw = Gateway::start(&[&w], "").await;
    let path = temp_file_with("expect", ".json", body_of_size(2 << 20));
    let out = std::process::Command::new("curl")
        .args([
            "-sv",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "-H",
            "content-type: application/json",
        ])
        .args([
            "-H",
            "Expect: 100-continue",
            "--data-binary",
            &format!("@{}", path.display()),
        ])
        .arg(format!("{}/v1/chat/completions", gw.url()))
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&path);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "200");
    // The gateway answers the expectation itself (curl would otherwise wait 1 s for it and
    // send the body anyway, so the interim response is what shows it is not stalled).
    let trace = String::from_utf8_lossy(&out.stderr);
    assert!(trace.contains("< HTTP/1.1 100 Continue"), "{trace}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_openai_errors_naming_the_field() {
    let w = Worker::start(&[]).await;
    let gw = Gateway::start(&[&w], "").await;
    let client = client();
    let post = |path: &'static str, body: &'static str| {
        let (client, url) = (client.clone(), gw.url());
        async move {
            let r = client
                .post(format!("{url}{path}"))
                .body(body)
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            let v: serde_json::Value = r.json().await.unwrap();
            (status, v["error"].clone())
        }
    };
    let (s, e) = post("/v1/chat/completions", "{not json").await;
    assert_eq!(s, 400);
    assert!(
        e["message"].as_str().unwrap().contains("not valid JSON"),
        "{e}"
    );
    // Two bodies back to back are not one request (the worker would read only the first).
    let (s, e) = post(
        "/v1/completions",
        r#"{"model":"test-model","prompt":"a"}{"model":"test-model","prompt":"b"}"#,
    )
    .await;
    assert_eq!(s, 400);
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .contains("trailing characters"),
        "{e}"
    );
    let (s, e) = post(
        "/v1/chat/completions",
        r#"{"model":"test-model","messages":"hi"}"#,
    )
    .await;
    assert_eq!((s, e["param"].as_str()), (400, Some("messages")), "{e}");
    let (s, e) = post(
        "/v1/chat/completions",
        r#"{"messages":[{"role":"user","content":"x"}]}"#,
    )
    .await;
    assert_eq!((s, e["param"].as_str()), (400, Some("model")), "{e}");
    let (s, e) = post("/v1/completions", r#"{"model":"test-model"}"#).await;
    assert_eq!((s, e["param"].as_str()), (400, Some("prompt")), "{e}");
    let (s, e) = post(
        "/v1/completions",
        r#"{"model":"test-model","prompt":"x","max_tokens":"ten"}"#,
    )
    .await;
    assert_eq!((s, e["param"].as_str()), (400, Some("max_tokens")), "{e}");
    let (s, e) = post(
        "/v1/chat/completions",
        r#"{"model":"gpt-9","messages":[{"role":"user","content":"x"}]}"#,
    )
    .await;
    assert_eq!(
        (s, e["code"].as_str()),
        (404, Some("model_not_found")),
        "{e}"
    );
    let (s, _) = post("/v1/nothing", "{}").await;
    assert_eq!(s, 404);
    assert_eq!(
        w.stats().await["requests"],
        0,
        "no bad request reaches a worker"
    );

    // No healthy replica: 503 with Retry-After.
    w.set_faults(serde_json::json!({ "healthy": false })).await;
    gw.wait_until(|r| r.iter().all(|r| r["available"] == false))
        .await;
    let r = client
        .post(format!("{}/v1/completions", gw.url()))
        .json(&completion("x", false))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    assert!(r.headers().contains_key("retry-after"));
    w.set_faults(serde_json::json!({})).await;
    gw.wait_until(|r| r.iter().all(|r| r["available"] == true))
        .await;
    assert_eq!(
        send(
            &client,
            &gw.url(),
            "/v1/completions",
            &completion("back", false)
        )
        .await
        .status,
        200
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_503_or_429_moves_the_request_to_the_next_replica() {
    let failing = Worker::start(&["--error-rate", "1.0"]).await;
    let limited = Worker::start(&["--error-rate", "1.0", "--error-status", "429"]).await;
    let good = Worker::start(&[]).await;
    // Failures would eject the 503 worker; keep it in to prove every request retries.
    let gw = Gateway::start(
        &[&failing, &limited, &good],
        "health:\n  interval_ms: 200\n  eject_after_failures: 1000\n",
    )
    .await;
    let client = client();
    for i in 0..20 {
        let body = if i % 2 == 0 {
            chat(&format!("retry {i}"), true)
        } else {
            completion(&format!("retry {i}"), false)
        };
        let path = if i % 2 == 0 {
            "/v1/chat/completions"
        } else {
            "/v1/completions"
        };
        let answer = send(&client, &gw.url(), path, &body).await;
        assert_eq!(
            (answer.status, answer.text.as_str()),
            (200, format!("retry {i}").as_str())
        );
        assert_eq!(answer.replica.as_deref(), Some(good.id().as_str()));
    }
    let metrics = gw.metrics().await;
    assert!(
        metrics.contains("kvgate_retries_total{reason=\"status_503\"}"),
        "{metrics}"
    );
    assert!(
        metrics.contains("kvgate_retries_total{reason=\"status_429\"}"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_disconnect_cancels_the_upstream_request() {
    let w = Worker::start(&["--token-delay-ms", "100"]).await;
    let gw = Gateway::start(&[&w], "").await;
    let mut resp = client()
        .post(format!("{}/v1/completions", gw.url()))
        .json(&completion(
            "one two three four five six seven eight nine ten",
            true,
        ))
        .send()
        .await
        .unwrap();
    assert!(resp.chunk().await.unwrap().is_some());
    drop(resp);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while w.stats().await["cancelled"] != 1 {
        assert!(
            std::time::Instant::now() < deadline,
            "worker never saw the cancel: {}",
            w.stats().await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(w.stats().await["in_flight"], 0);
    assert!(gw
        .metrics()
        .await
        .contains("kvgate_client_disconnects_total 1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_dropping_a_stream_mid_way_ends_it_with_an_error_event() {
    let w = Worker::start(&["--disconnect-rate", "1.0", "--disconnect-after", "2"]).await;
    let gw = Gateway::start(&[&w], "").await;
    let answer = send(
        &client(),
        &gw.url(),
        "/v1/completions",
        &completion("a b c d e", true),
    )
    .await;
    assert_eq!(answer.status, 200);
    assert_eq!(answer.text, "a b ");
    assert!(answer.stream_error && !answer.done, "{answer:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_worker_times_out_instead_of_hanging_the_client() {
    let w = Worker::start(&["--hang-rate", "1.0"]).await;
    let gw = Gateway::start(&[&w], "timeouts:\n  first_byte_ms: 300\n").await;
    let started = std::time::Instant::now();
    let answer = send(
        &client(),
        &gw.url(),
        "/v1/completions",
        &completion("x", false),
    )
    .await;
    assert_eq!(answer.status, 504);
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_under_load_fails_only_its_streams_and_returns_when_healthy() {
    let slow = ["--token-delay-ms", "30"];
    let (a, mut b, c) = (
        Worker::start(&slow).await,
        Worker::start(&slow).await,
        Worker::start(&slow).await,
    );
    let b_port = b.port;
    let gw = Gateway::start(&[&a, &b, &c], "").await;
    let client = client();

    let load = |offset: usize| {
        let (client, url) = (client.clone(), gw.url());
        tokio::spawn(async move {
            let mut outcomes = Vec::new();
            for i in 0..12 {
                let content = format!("load {offset} {i} one two three four five six seven eight");
                let stream = i % 3 != 0;
                let body = chat(&content, stream);
                let answer = tokio::time::timeout(
                    Duration::from_secs(15),
                    send(&client, &url, "/v1/chat/completions", &body),
                )
                .await
                .expect("a request hung");
                outcomes.push((answer, content));
            }
            outcomes
        })
    };
    let tasks: Vec<_> = (0..8).map(load).collect();
    tokio::time::sleep(Duration::from_millis(400)).await;
    b.proc.kill();
    let mut ok = 0;
    let mut failed_on_b = 0;
    for t in tasks {
        for (answer, content) in t.await.unwrap() {
            if answer.status == 200 && !answer.stream_error {
                assert_eq!(answer.text, content);
                ok += 1;
            } else {
                // Only requests already on the killed worker may fail, and they fail clearly.
                assert_eq!(
                    answer.replica.as_deref(),
                    Some(format!("w{b_port}").as_str()),
                    "{answer:?}"
                );
                assert!(answer.stream_error || answer.status >= 500, "{answer:?}");
                failed_on_b += 1;
            }
        }
    }
    assert_eq!(ok + failed_on_b, 96);
    assert!(
        failed_on_b <= 8,
        "at most the 8 requests in flight on it fail, got {failed_on_b}"
    );

    let b_id = format!("w{b_port}");
    gw.wait_until(|r| {
        r.iter()
            .any(|r| r["id"] == b_id.as_str() && r["available"] == false)
    })
    .await;
    let b = Worker::start_on(b_port, &[]).await;
    gw.wait_until(|r| r.iter().all(|r| r["available"] == true))
        .await;
    // Back in rotation: distinct prompts reach it again.
    let mut reached = false;
    for i in 0..30 {
        let answer = send(
            &client,
            &gw.url(),
            "/v1/completions",
            &completion(&format!("after {i}"), false),
        )
        .await;
        assert_eq!(answer.status, 200);
        reached |= answer.replica.as_deref() == Some(b.id().as_str());
    }
    assert!(reached, "the restarted worker gets traffic again");
}

/// Sends requests until the `bad` worker (faulty by `flags`, its /health fine) has been
/// ejected three times in a row (300, 600, 1,200 ms), health checks passing in between.
async fn ejections_grow(flags: &[&str], stream: bool) {
    let bad = Worker::start(flags).await;
    wait_ok(&format!("{}/health", bad.url())).await;
    let good = Worker::start(&[]).await;
    let gw = Gateway::start(
        &[&bad, &good],
        "health:\n  interval_ms: 100\n  eject_after_failures: 2\n  ejection_base_ms: 300\n  ejection_max_ms: 60000\n",
    )
    .await;
    let c = client();
    let deadline = Instant::now() + Duration::from_secs(30);
    for round in 0.. {
        // Prompts of their own, so that the ring places some on each replica.
        for i in 0..4 {
            let prompt = format!("question {round} {i} with some more words");
            let _ = send(
                &c,
                &gw.url(),
                "/v1/completions",
                &completion(&prompt, stream),
            )
            .await;
        }
        let replicas = gw.replicas().await;
        let row = replicas.iter().find(|r| r["id"] == bad.id()).unwrap();
        if row["ejections_in_a_row"].as_u64().unwrap() >= 3 {
            break;
        }
        assert!(Instant::now() < deadline, "the back-off never grew: {row}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_passes_health_checks_but_fails_requests_is_ejected_for_longer_each_time() {
    ejections_grow(&["--error-rate", "1.0", "--error-status", "500"], false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_drops_every_stream_half_way_is_ejected_for_longer_each_time() {
    // Its response headers say 200: only a whole answer counts as a success.
    ejections_grow(
        &["--disconnect-rate", "1.0", "--disconnect-after", "2"],
        true,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_answering_garbage_is_ejected_for_longer_each_time() {
    // A 200 whose stream never ends with `[DONE]` is no success.
    ejections_grow(&["--garbage-rate", "1.0"], true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_ends_without_done_gets_an_error_event() {
    let bad = Worker::start(&["--garbage-rate", "1.0"]).await;
    let gw = Gateway::start(&[&bad], "").await;
    let resp = client()
        .post(format!("{}/v1/completions", gw.url()))
        .json(&completion("hi", true))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let raw = resp.bytes().await.unwrap();
    let events = kvgate_protocol::sse::SseParser::default().push(&raw);
    let last: serde_json::Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(last["error"]["code"], "bad_gateway", "{last}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_dying_before_it_answers_hands_the_request_to_the_next() {
    // Both answer after 2 s; whichever gets the request is killed before it answers.
    let mut workers = [
        Worker::start(&["--first-token-delay-ms", "2000"]).await,
        Worker::start(&["--first-token-delay-ms", "2000"]).await,
    ];
    let gw = Gateway::start(&[&workers[0], &workers[1]], "").await;
    let url = gw.url();
    let request = tokio::spawn(async move {
        send(&client(), &url, "/v1/completions", &completion("hi", false)).await
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    let busy = loop {
        let mut found = None;
        for (i, w) in workers.iter().enumerate() {
            if w.stats().await["in_flight"] == 1 {
                found = Some(i);
            }
        }
        if let Some(i) = found {
            break i;
        }
        assert!(Instant::now() < deadline, "no worker got the request");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let killed = workers[busy].id();
    workers[busy].proc.kill();
    let answer = request.await.unwrap();
    assert_eq!(answer.status, 200, "{answer:?}");
    assert_ne!(
        answer.replica,
        Some(killed),
        "answered by the other replica"
    );
}
