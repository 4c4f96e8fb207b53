//! Large prompts against the worker and the gateway in token mode: text too long for the
//! context is refused before it is tokenized, and a long prompt being tokenized never holds
//! up `/health` or other requests.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use std::time::{Duration, Instant};

/// A chat body whose user message is `bytes` long, made of common words.
fn long_chat(bytes: usize) -> serde_json::Value {
    let words = [
        "the ", "quick ", "brown ", "fox ", "jumps ", "over ", "a ", "dog. ",
    ];
    let mut text = String::with_capacity(bytes + 8);
    let mut i = 0;
    while text.len() < bytes {
        text.push_str(words[i % words.len()]);
        i += 1;
    }
    serde_json::json!({ "model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4 })
}

/// A chat through a client that waits for a debug build's long tokenization.
async fn chat_post(url: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
    let c = reqwest::Client::builder()
        .timeout(Duration::from_secs(300))
        .build()
        .unwrap();
    post_with(&c, url, "/v1/chat/completions", body).await
}

/// Sends a long prompt (one the byte bound lets through, so it is tokenized in full, which
/// takes a while in a debug build) and asks `/health` again and again meanwhile: tokenized on
/// the serving thread, the prompt would hold one answer back for about as long as it takes;
/// off it, every answer comes at once. Relative, so it holds on a fast machine and a slow one.
async fn health_answers_during_a_long_prompt(url: &str) {
    let sent = Instant::now();
    let big = tokio::spawn({
        let url = url.to_string();
        async move { chat_post(&url, &long_chat(600_000)).await }
    });
    let client = reqwest::Client::new();
    let (mut asked, mut slowest) = (0, Duration::ZERO);
    while !big.is_finished() {
        let start = Instant::now();
        let health = client
            .get(format!("{url}/health"))
            .timeout(Duration::from_secs(120))
            .send()
            .await
            .unwrap();
        assert_eq!(health.status(), 200);
        asked += 1;
        slowest = slowest.max(start.elapsed());
    }
    let took = sent.elapsed();
    assert!(asked > 1, "the long prompt took no time: {took:?}");
    assert!(
        slowest * 4 < took,
        "/health waited for the long prompt: {slowest:?} of its {took:?}"
    );
    let (status, body) = big.await.unwrap();
    assert_eq!(status, 400, "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("maximum context length"), "{message}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_refuses_text_too_long_for_its_context_before_tokenizing() {
    let w = SimWorker::start(&["--time-scale", "0.01"]).await;
    let (status, body) = chat_post(&w.url(), &long_chat(4 << 20)).await;
    assert_eq!(status, 400, "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("bytes of text"), "{message}");
    assert_eq!(body["error"]["param"], "messages");
    let (status, body) = chat_post(&w.url(), &long_chat(200)).await;
    assert_eq!(status, 200, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_answers_health_while_it_tokenizes_a_long_prompt() {
    let w = SimWorker::start(&["--time-scale", "0.01"]).await;
    health_answers_during_a_long_prompt(&w.url()).await;
}

fn token_mode(threads: usize) -> String {
    let model = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    format!(
        "threads: {threads}\ntokenizers:\n  - model: {MODEL}\n    path: \"{}\"\n",
        model.display()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_refuses_text_too_long_for_the_context_without_forwarding_it() {
    let w = Worker::start(&[]).await;
    let gw = Gateway::start(&[&w], &token_mode(2)).await;
    let (status, body) = chat_post(&gw.url(), &long_chat(4 << 20)).await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("bytes of text"),
        "{body}"
    );
    assert_eq!(w.stats().await["requests"], 0, "the worker saw it");
    let (status, _) = chat_post(&gw.url(), &long_chat(200)).await;
    assert_eq!(status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_answers_health_while_it_tokenizes_a_long_prompt() {
    let w = Worker::start(&[]).await;
    // One thread: a prompt tokenized in place would hold up every other connection.
    let gw = Gateway::start(&[&w], &token_mode(1)).await;
    health_answers_during_a_long_prompt(&gw.url()).await;
}
