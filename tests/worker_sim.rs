//! The worker with the sim backend, over HTTP: prefix caching, KV events, disconnects, bad
//! input, KV exhaustion, and behind the gateway.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use kvgate_protocol::kv_events::{apply, KvEvent, KvEventBatch, KvSnapshot};
use std::collections::HashSet;
use std::time::{Duration, Instant};

fn tokens_prompt(tokens: &[u32], max_tokens: u32, stream: bool) -> serde_json::Value {
    serde_json::json!({ "model": MODEL, "prompt": tokens, "max_tokens": max_tokens, "stream": stream, "ignore_eos": true })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_2048_token_prefix_is_reported_as_cached() {
    let w = SimWorker::start(&["--time-scale", "0.01"]).await;
    let prefix: Vec<u32> = (0..2048).map(|i| 100 + i).collect();
    let (s, first) = post(
        &w.url(),
        "/v1/completions",
        &tokens_prompt(&[prefix.clone(), vec![7, 8, 9]].concat(), 2, false),
    )
    .await;
    assert_eq!(s, 200, "{first}");
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let (_, second) = post(
        &w.url(),
        "/v1/completions",
        &tokens_prompt(&[prefix, vec![10, 11, 12]].concat(), 2, false),
    )
    .await;
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached >= 2032, "cached_tokens {cached}");
    assert_eq!(second["usage"]["prompt_tokens"], 2051);
}

/// Reads `/kv/events` and keeps the replayed block set, up to some sequence number.
async fn follow_events(
    url: String,
    from: u64,
    set: std::sync::Arc<tokio::sync::Mutex<(HashSet<u64>, u64, usize)>>,
) {
    let mut resp = client()
        .get(format!("{url}/kv/events?from={from}"))
        .timeout(Duration::from_secs(120))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut buf = Vec::new();
    while let Ok(Some(chunk)) = resp.chunk().await {
        buf.extend_from_slice(&chunk);
        while let Some(nl) = buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = buf.drain(..=nl).collect();
            let batch: KvEventBatch = serde_json::from_slice(&line).unwrap();
            let mut state = set.lock().await;
            assert_eq!(batch.seq, state.1 + 1, "a gap in the event stream");
            state.2 += batch
                .events
                .iter()
                .filter(|e| matches!(e, KvEvent::Removed { .. }))
                .count();
            apply(&mut state.0, &batch);
            state.1 = batch.seq;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replaying_kv_events_reconstructs_the_cached_block_set() {
    // 300 blocks of 16 tokens: far less than the workload, so blocks are evicted constantly.
    let w = SimWorker::start(&[
        "--time-scale",
        "0.001",
        "--num-blocks",
        "300",
        "--max-model-len",
        "4800",
    ])
    .await;
    let state = std::sync::Arc::new(tokio::sync::Mutex::new((HashSet::new(), 0u64, 0usize)));
    let follower = tokio::spawn(follow_events(w.url(), 1, state.clone()));
    let mut tasks = tokio::task::JoinSet::new();
    for t in 0..8u32 {
        let url = w.url();
        tasks.spawn(async move {
            let c = client();
            for i in 0..125u32 {
                let n = t * 125 + i;
                // 40 prefix groups; random-ish lengths from 20 to 419 tokens.
                let group = (n * 7919) % 40;
                let len = 20 + (n * 104_729) % 400;
                let prompt: Vec<u32> = (0..len)
                    .map(|k| {
                        if k < 64 + group {
                            1000 + group * 100 + k
                        } else {
                            20_000 + n * 7 + k
                        }
                    })
                    .collect();
                let r = c
                    .post(format!("{url}/v1/completions"))
                    .json(&tokens_prompt(&prompt, 1 + n % 3, false))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status(), 200);
            }
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }
    let snapshot: KvSnapshot = serde_json::from_value(w.get("/kv/snapshot").await).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let s = state.lock().await;
        if s.1 >= snapshot.seq {
            assert_eq!(
                s.1, snapshot.seq,
                "events after the snapshot on an idle worker"
            );
            let mut replayed: Vec<u64> = s.0.iter().copied().collect();
            replayed.sort_unstable();
            assert_eq!(
                replayed, snapshot.hashes,
                "replayed set differs from the worker's"
            );
            assert!(
                s.2 > 100,
                "the workload should have evicted blocks, saw {} removals",
                s.2
            );
            break;
        }
        drop(s);
        assert!(Instant::now() < deadline, "the event stream fell behind");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let stats = w.get("/stats").await;
    assert_eq!(
        stats["engine"]["kv_blocks_cached"].as_u64().unwrap() as usize,
        snapshot.hashes.len()
    );
    follower.abort();

    // A replay from before the retained log is refused with a pointer to the snapshot.
    let gone = client()
        .get(format!("{}/kv/events?from=0", w.url()))
        .send()
        .await
        .unwrap();
    assert!(gone.status() == 200 || gone.status() == 410);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_mid_stream_frees_its_blocks() {
    let w = SimWorker::start(&["--time-scale", "1"]).await;
    let prompt: Vec<u32> = (0..500).map(|i| 300 + i).collect();
    let mut resp = client()
        .post(format!("{}/v1/completions", w.url()))
        .json(&tokens_prompt(&prompt, 5000, true))
        .send()
        .await
        .unwrap();
    assert!(resp.chunk().await.unwrap().is_some());
    let busy = w.get("/stats").await;
    assert_eq!(busy["engine"]["running"], 1);
    drop(resp);
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let e = &w.get("/stats").await["engine"];
        if e["running"] == 0 && e["waiting"] == 0 && e["kv_blocks_free"] == e["kv_blocks_total"] {
            break;
        }
        assert!(Instant::now() < deadline, "request not aborted: {e}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_clear_errors() {
    let w = SimWorker::start(&["--max-model-len", "256", "--time-scale", "0.01"]).await;
    let (s, e) = post(
        &w.url(),
        "/v1/completions",
        &tokens_prompt(&[500; 300], 4, false),
    )
    .await;
    assert_eq!(s, 400);
    let msg = e["error"]["message"].as_str().unwrap();
    assert!(msg.contains("300") && msg.contains("256"), "{msg}");
    let (s, e) = post(
        &w.url(),
        "/v1/completions",
        &tokens_prompt(&[500; 200], 100, false),
    )
    .await;
    assert_eq!(
        (s, e["error"]["param"].as_str()),
        (400, Some("max_tokens")),
        "{e}"
    );
    let r = client()
        .post(format!("{}/v1/chat/completions", w.url()))
        .body("{\"model\":")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let mut body = tokens_prompt(&[500; 10], 1, false);
    body["model"] = "other".into();
    assert_eq!(post(&w.url(), "/v1/completions", &body).await.0, 404);
    body["model"] = MODEL.into();
    body["prompt"] = serde_json::json!([60000]);
    assert_eq!(
        post(&w.url(), "/v1/completions", &body).await.0,
        400,
        "token id outside the vocabulary"
    );
    assert_eq!(
        w.get("/stats").await["engine"]["steps"],
        0,
        "nothing bad reached the engine"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_exhaustion_queues_and_preempts_but_every_request_completes() {
    // 40 blocks = 640 tokens; 12 requests that each grow to 300 tokens. Slow enough (about
    // 0.1 s a request) that they overlap however the test machine schedules their arrival.
    let w = SimWorker::start(&[
        "--num-blocks",
        "40",
        "--max-model-len",
        "640",
        "--time-scale",
        "0.25",
    ])
    .await;
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..12u32 {
        let url = w.url();
        tasks.spawn(async move {
            let prompt: Vec<u32> = (0..200).map(|k| 1000 + i * 300 + k).collect();
            post(&url, "/v1/completions", &tokens_prompt(&prompt, 100, false)).await
        });
    }
    while let Some(r) = tasks.join_next().await {
        let (s, v) = r.unwrap();
        assert_eq!(s, 200, "{v}");
        assert_eq!(v["usage"]["completion_tokens"], 100);
    }
    // The last response can reach us a step before its blocks are released.
    let mut e = w.get("/stats").await["engine"].clone();
    for _ in 0..50 {
        if e["kv_blocks_free"] == e["kv_blocks_total"] {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        e = w.get("/stats").await["engine"].clone();
    }
    assert!(e["preemptions"].as_u64().unwrap() > 0, "{e}");
    assert_eq!(e["kv_blocks_free"], e["kv_blocks_total"], "{e}");
    let metrics = w.metrics().await;
    assert!(metrics.contains("vllm:num_preemptions_total"));
    assert!(metrics.contains("vllm:kv_cache_usage_perc"));
    assert!(metrics.contains("vllm:num_requests_waiting"));
}

#[test]
fn a_kv_cache_below_the_context_length_is_refused_at_start() {
    // 64 blocks hold 1,024 tokens; the model's context is 8,192: a request growing past the
    // cache would be preempted for ever, so the worker must not start.
    let out = kvgate()
        .args([
            "worker",
            "--backend",
            "sim",
            "--port",
            &free_port().to_string(),
        ])
        .args(["--num-blocks", "64"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("1024 tokens") && stderr.contains("--max-model-len"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_that_fill_the_context_all_finish_on_a_cache_of_one_context() {
    // A cache of exactly one context: requests whose max_tokens fill it preempt each other,
    // and every one of them still finishes (none parked in waiting for ever).
    let w = SimWorker::start(&[
        "--num-blocks",
        "64",
        "--max-model-len",
        "1024",
        "--time-scale",
        "0.02",
    ])
    .await;
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..6u32 {
        let url = w.url();
        tasks.spawn(async move {
            let prompt: Vec<u32> = (0..24).map(|k| 500 + i * 50 + k).collect();
            post(
                &url,
                "/v1/completions",
                &tokens_prompt(&prompt, 1000, false),
            )
            .await
        });
    }
    let all = tokio::time::timeout(Duration::from_secs(120), async {
        while let Some(r) = tasks.join_next().await {
            let (s, v) = r.unwrap();
            assert_eq!(s, 200, "{v}");
            assert_eq!(v["usage"]["completion_tokens"], 1000);
        }
    })
    .await;
    assert!(all.is_ok(), "a request hung: {}", w.get("/stats").await);
    assert!(
        w.get("/stats").await["engine"]["preemptions"]
            .as_u64()
            .unwrap()
            > 0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_strings_and_streaming_usage() {
    let w = SimWorker::start(&["--time-scale", "0.01"]).await;
    // Learn what the sim generates for this prompt, then stop on a piece of it.
    let body = serde_json::json!({ "model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "ignore_eos": true });
    let (_, full) = post(&w.url(), "/v1/completions", &body).await;
    let text = full["choices"][0]["text"].as_str().unwrap().to_string();
    let stop: String = text
        .chars()
        .skip(text.chars().count() / 2)
        .take(3)
        .collect();
    let mut with_stop = body.clone();
    with_stop["stop"] = serde_json::json!([stop]);
    let (_, stopped) = post(&w.url(), "/v1/completions", &with_stop).await;
    let cut = stopped["choices"][0]["text"].as_str().unwrap();
    assert_eq!(cut, &text[..text.find(&stop).unwrap()]);
    assert_eq!(stopped["choices"][0]["finish_reason"], "stop");

    let mut streamed = body.clone();
    streamed["stream"] = true.into();
    streamed["stream_options"] = serde_json::json!({ "include_usage": true });
    let raw = client()
        .post(format!("{}/v1/completions", w.url()))
        .json(&streamed)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let (streamed_text, error, done) = parse_sse(&raw);
    assert!(!error && done);
    assert_eq!(streamed_text, text, "streaming and not give the same text");
    assert!(raw.contains("\"completion_tokens\":12"), "{raw}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_routes_shared_prefixes_to_the_sim_worker_that_caches_them() {
    let ws = [
        SimWorker::start(&["--time-scale", "0.01"]).await,
        SimWorker::start(&["--time-scale", "0.01"]).await,
        SimWorker::start(&["--time-scale", "0.01"]).await,
    ];
    let gw = Gateway::start(&[&ws[0], &ws[1], &ws[2]], "").await;
    let system = "You are a meticulous assistant who follows the house style guide. ".repeat(40);
    let mut replica = None;
    for i in 0..10 {
        let body = serde_json::json!({
            "model": MODEL, "max_tokens": 4,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": format!("question {i}")}],
        });
        let resp = client()
            .post(format!("{}/v1/chat/completions", gw.url()))
            .header("x-kvgate-debug", "1")
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let r = resp.headers()["x-kvgate-replica"]
            .to_str()
            .unwrap()
            .to_string();
        assert_eq!(
            replica.get_or_insert(r.clone()),
            &r,
            "request {i} left the replica holding the prefix"
        );
        let v: serde_json::Value = resp.json().await.unwrap();
        let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        if i > 0 {
            // The system prompt is about 480 tokens.
            assert!(
                cached > 400,
                "request {i} should reuse the system prompt's KV, cached {cached}"
            );
        }
    }
}

/// Logprobs in both layouts, streamed and not; the sim backend's distribution is a point mass
/// on the token it emits, so each token has logprob 0 and is its own only top entry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_in_chat_and_completion_layouts() {
    let w = SimWorker::start(&["--time-scale", "0.01"]).await;
    let mut body = chat("tell me", false);
    body["max_tokens"] = 5.into();
    body["logprobs"] = true.into();
    body["top_logprobs"] = 2.into();
    let (s, r) = post(&w.url(), "/v1/chat/completions", &body).await;
    assert_eq!(s, 200, "{r}");
    let content = r["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 5, "{r}");
    for e in content {
        assert_eq!(e["logprob"], 0.0);
        assert_eq!(e["top_logprobs"].as_array().unwrap().len(), 1);
        assert_eq!(e["top_logprobs"][0]["token"], e["token"]);
        let bytes: Vec<u8> = serde_json::from_value(e["bytes"].clone()).unwrap();
        assert_eq!(
            String::from_utf8_lossy(&bytes),
            e["token"].as_str().unwrap()
        );
    }

    // Streamed: every token's entry arrives once, with the chunks.
    body["stream"] = true.into();
    let raw = client()
        .post(format!("{}/v1/chat/completions", w.url()))
        .json(&body)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let entries: usize = raw
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|c| {
            c["choices"][0]["logprobs"]["content"]
                .as_array()
                .map(Vec::len)
        })
        .sum();
    assert_eq!(entries, 5, "{raw}");

    let mut completion = tokens_prompt(&[500; 8], 4, false);
    completion["logprobs"] = 0.into();
    let (s, r) = post(&w.url(), "/v1/completions", &completion).await;
    assert_eq!(s, 200, "{r}");
    let lp = &r["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 4, "{r}");
    assert_eq!(
        lp["token_logprobs"],
        serde_json::json!([0.0, 0.0, 0.0, 0.0])
    );
    assert_eq!(lp["text_offset"][0], 0);
    assert!(lp["top_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .all(|m| m.as_object().unwrap().is_empty()));

    // Bad requests name the field.
    for (path, patch, param) in [
        (
            "/v1/completions",
            serde_json::json!({"logprobs": 21}),
            "logprobs",
        ),
        (
            "/v1/completions",
            serde_json::json!({"logprobs": true}),
            "logprobs",
        ),
        (
            "/v1/chat/completions",
            serde_json::json!({"logprobs": 3}),
            "logprobs",
        ),
        (
            "/v1/chat/completions",
            serde_json::json!({"top_logprobs": 3}),
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            serde_json::json!({"logprobs": true, "top_logprobs": 50}),
            "top_logprobs",
        ),
    ] {
        let mut b = if path == "/v1/completions" {
            tokens_prompt(&[500; 8], 2, false)
        } else {
            chat("hi", false)
        };
        for (k, v) in patch.as_object().unwrap() {
            b[k] = v.clone();
        }
        let (s, e) = post(&w.url(), path, &b).await;
        assert_eq!(
            (s, e["error"]["param"].as_str()),
            (400, Some(param)),
            "{patch}: {e}"
        );
    }
}

/// The sim's clock: a token exists when the step that computed it ends, so a 4,000-token
/// prompt (two steps of the 2,048-token budget) answers no sooner than both steps' modelled
/// time, times the time scale. (A lower bound only: a busy machine may add to it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_token_waits_for_the_whole_modelled_prefill() {
    use kvgate_worker::backend::profile::Profile;
    let scale = 2.0;
    let w = SimWorker::start(&["--time-scale", "2"]).await;
    let profile = Profile::load("config/profiles/h200-llama-3.1-8b-bf16.yaml".as_ref()).unwrap();
    let modelled = profile.step_seconds(std::iter::once((0, 2048)))
        + profile.step_seconds(std::iter::once((2048, 1952)));
    let prompt: Vec<u32> = (0..4000).map(|i| 100 + i).collect();
    let started = Instant::now();
    let (s, body) = post(
        &w.url(),
        "/v1/completions",
        &tokens_prompt(&prompt, 1, false),
    )
    .await;
    let elapsed = started.elapsed().as_secs_f64();
    assert_eq!(s, 200, "{body}");
    assert_eq!(body["usage"]["prompt_tokens"], 4000);
    assert!(
        elapsed >= modelled * scale,
        "answered after {elapsed:.3} s, before the modelled prefill ({:.3} s)",
        modelled * scale
    );
}

/// Out of descriptors, the worker's accept fails at once until a connection closes: it pauses
/// between tries instead of spinning (a core burnt, the log flooded), and serves again once the
/// connections close.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_out_of_descriptors_pauses_instead_of_spinning() {
    // 64 descriptors, the hard limit too, so that the worker cannot raise it.
    let (proc, port) = start_on_free_port("sim-64-files", |port| {
        let mut cmd = std::process::Command::new("prlimit");
        cmd.current_dir(env!("CARGO_MANIFEST_DIR"))
            .args(["--nofile=64:64", env!("CARGO_BIN_EXE_kvgate")])
            .args(["worker", "--backend", "sim", "--port", &port.to_string()])
            .args(["--served-model-name", MODEL]);
        cmd
    })
    .await;
    let flood: Vec<_> = (0..100)
        .filter_map(|_| std::net::TcpStream::connect(("127.0.0.1", port)).ok())
        .collect();
    assert_eq!(
        flood.len(),
        100,
        "the kernel queues what the worker cannot accept"
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    let log = std::fs::read_to_string(&proc.log).unwrap();
    let failed = log.matches("accept failed").count();
    assert!(failed > 0, "descriptors ran out: {log}");
    assert!(failed < 200, "{failed} failed accepts in 2 s");
    drop(flood);
    wait_ok(&format!("http://127.0.0.1:{port}/health")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_headers_slow_bodies_and_idle_connections_are_closed_at_their_deadlines() {
    use std::io::Write;
    let w = SimWorker::start(&[
        "--time-scale",
        "0.01",
        "--header-timeout-ms",
        "500",
        "--body-timeout-ms",
        "500",
    ])
    .await;
    let port = w.port;
    let connect = move || {
        let s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s
    };
    let health = b"GET /health HTTP/1.1\r\nHost: w\r\n\r\n";
    tokio::task::spawn_blocking(move || {
        // Half a header, then nothing: closed once its deadline passes, not before.
        let mut s = connect();
        let start = Instant::now();
        s.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: w\r\n").unwrap();
        assert_eq!(read_to_close(&mut s), "");
        let waited = start.elapsed();
        assert!(waited >= Duration::from_millis(400), "closed after {waited:?}");
        assert!(waited < Duration::from_secs(5), "closed after {waited:?}");

        // A whole header, then a tenth of its body: 408, and the connection closed.
        let mut s = connect();
        s.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: w\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\":")
            .unwrap();
        let start = Instant::now();
        let answer = read_to_close(&mut s);
        assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
        assert!(start.elapsed() < Duration::from_secs(5), "left open");
        assert!(answer.contains("request body not received within 500 ms"), "{answer}");

        // Kept alive: a request after a pause shorter than the deadline is served; after a
        // longer one the worker has closed the connection.
        let mut s = connect();
        s.write_all(health).unwrap();
        std::thread::sleep(Duration::from_millis(200));
        s.write_all(health).unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        while got.windows(15).filter(|w| w == b"HTTP/1.1 200 OK").count() < 2 {
            let n = std::io::Read::read(&mut s, &mut buf).unwrap();
            assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&got));
            got.extend_from_slice(&buf[..n]);
        }
        std::thread::sleep(Duration::from_millis(1_500));
        let _ = s.write_all(health);
        assert!(!read_to_close(&mut s).contains("200 OK"));
    })
    .await
    .unwrap();
}
