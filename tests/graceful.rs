//! Stopping the gateway without cutting anyone off: SIGTERM lets streams in flight finish
//! within the grace period and ends the rest with an error event; a graceful upgrade hands the
//! listening sockets to a new process while requests keep succeeding.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use std::time::{Duration, Instant};

/// A streamed completion of `words` tokens (the test worker echoes the prompt's words).
fn long_stream(words: usize) -> serde_json::Value {
    let prompt: Vec<String> = (0..words).map(|i| format!("w{i}")).collect();
    serde_json::json!({ "model": MODEL, "prompt": prompt.join(" "), "max_tokens": words, "stream": true })
}

fn streaming(url: String, words: usize) -> tokio::task::JoinHandle<Answer> {
    tokio::spawn(async move {
        let c = reqwest::Client::builder()
            .timeout(Duration::from_secs(60))
            .build()
            .unwrap();
        send(&c, &url, "/v1/completions", &long_stream(words)).await
    })
}

/// Waits until the worker has `n` requests in flight.
async fn in_flight(w: &Worker, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while w.stats().await["in_flight"] != n {
        assert!(
            Instant::now() < deadline,
            "{} never had {n} in flight",
            w.id()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_streams_in_flight_finish() {
    // 40 tokens 200 ms apart: an 8 s stream, longer than Pingora's own 5 s grace.
    let w = Worker::start(&["--token-delay-ms", "200"]).await;
    let mut gw = Gateway::start(&[&w], "shutdown_grace_ms: 30000\n").await;
    let stream = streaming(gw.url(), 40);
    in_flight(&w, 1).await;
    gw.proc.signal("TERM");
    // New connections are refused at once.
    let deadline = Instant::now() + Duration::from_secs(5);
    while std::net::TcpStream::connect(("127.0.0.1", gw.port)).is_ok() {
        assert!(Instant::now() < deadline, "still accepting after SIGTERM");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let answer = stream.await.unwrap();
    assert!(answer.done && !answer.stream_error, "{answer:?}");
    assert_eq!(answer.text.split_whitespace().count(), 40, "{answer:?}");
    // Nothing left in flight: it exits without sleeping out the grace period.
    let status = gw.proc.exits();
    assert!(status.success(), "{status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_still_running_when_the_grace_period_ends_get_an_error_event() {
    let w = Worker::start(&["--token-delay-ms", "200"]).await;
    let mut gw = Gateway::start(&[&w], "shutdown_grace_ms: 1000\n").await;
    let stream = streaming(gw.url(), 40);
    in_flight(&w, 1).await;
    gw.proc.signal("TERM");
    let answer = stream.await.unwrap();
    assert!(
        answer.stream_error && !answer.done,
        "cut without a word: {answer:?}"
    );
    assert!(gw.proc.exits().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_upgrade_loses_no_request() {
    let w = Worker::start(&["--token-delay-ms", "100"]).await;
    let mut old = Gateway::start(&[&w], "shutdown_grace_ms: 20000\n").await;
    let long = streaming(old.url(), 60);
    in_flight(&w, 1).await;

    // The new binary waits for the sockets; the old one hands them over on SIGQUIT.
    let mut cmd = kvgate();
    cmd.args([
        "gateway",
        "--upgrade",
        "--config",
        old.config.to_str().unwrap(),
    ]);
    let mut new = spawn(cmd, &format!("gateway-upgrade-{}", old.port));
    tokio::time::sleep(Duration::from_millis(500)).await;
    old.proc.signal("QUIT");

    // Requests all through the hand-over, each on a new connection.
    let started = Instant::now();
    let mut served = 0;
    while started.elapsed() < Duration::from_secs(8) {
        let c = reqwest::Client::builder()
            .pool_max_idle_per_host(0)
            .timeout(Duration::from_secs(20))
            .build()
            .unwrap();
        let a = send(
            &c,
            &old.url(),
            "/v1/completions",
            &completion("quick one", false),
        )
        .await;
        assert_eq!(a.status, 200, "request {served} during the upgrade: {a:?}");
        served += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(served > 20, "{served}");
    let answer = long.await.unwrap();
    assert!(answer.done && !answer.stream_error, "{answer:?}");
    assert!(
        old.proc.exits().success(),
        "the old gateway exits once drained"
    );
    assert!(
        new.child.try_wait().unwrap().is_none(),
        "the new one serves on"
    );
    let a = send(
        &client(),
        &old.url(),
        "/v1/completions",
        &completion("after", false),
    )
    .await;
    assert_eq!(a.status, 200);
    new.kill();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_on_sigterm_finishes_its_streams_and_refuses_new_connections() {
    // About 40 decode steps of the sim, slowed to take a few seconds.
    let mut w = SimWorker::start(&["--time-scale", "20"]).await;
    let body = serde_json::json!({ "model": MODEL, "prompt": "tell me a long story", "max_tokens": 40, "ignore_eos": true, "stream": true });
    let url = w.url();
    let stream = tokio::spawn(async move {
        let c = reqwest::Client::builder()
            .timeout(Duration::from_secs(60))
            .build()
            .unwrap();
        send(&c, &url, "/v1/completions", &body).await
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while w.get("/stats").await["engine"]["running"] != 1 {
        assert!(Instant::now() < deadline, "the stream never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    w.proc.signal("TERM");
    let deadline = Instant::now() + Duration::from_secs(5);
    while std::net::TcpStream::connect(("127.0.0.1", w.port)).is_ok() {
        assert!(Instant::now() < deadline, "still accepting after SIGTERM");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let answer = stream.await.unwrap();
    assert!(answer.done && !answer.stream_error, "{answer:?}");
    assert!(w.proc.exits().success());
}
