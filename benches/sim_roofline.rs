//! Does one sim worker reproduce its profile's roofline over HTTP? Starts
//! `kvgate worker --backend sim` with the H200 profile at real time (time scale 1) and measures,
//! as a client sees them: single-stream decode rate (from inter-token gaps), prefill time of a
//! 4,096-token prompt, and aggregate decode rate of 32 concurrent streams. Each is compared with
//! what the profile's formula predicts for the same step shapes; the check passes within 10 %.
//! Run: `cargo bench --bench sim_roofline`
// Benchmarks are not request paths: failing loudly is what they should do.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use kvgate_worker::backend::profile::Profile;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const PROFILE: &str = "config/profiles/h200-llama-3.1-8b-bf16.yaml";

fn main() {
    let root = env!("CARGO_MANIFEST_DIR");
    let profile =
        Profile::load(&std::path::Path::new(root).join(PROFILE)).unwrap_or_else(|e| panic!("{e}"));
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(18999);
    let mut worker = Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .current_dir(root)
        .args([
            "worker",
            "--backend",
            "sim",
            "--port",
            &port.to_string(),
            "--served-model-name",
            "m",
            "--profile",
            PROFILE,
        ])
        .args([
            "--max-model-len",
            "16384",
            "--max-num-batched-tokens",
            "8192",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("{e}"));
    let runtime = tokio::runtime::Runtime::new().unwrap_or_else(|e| panic!("{e}"));
    let rows = runtime.block_on(measure(port, &profile));
    let _ = worker.kill();
    let _ = worker.wait();
    println!(
        "Sim backend vs its profile ({}), over HTTP, time scale 1:",
        profile.name
    );
    println!("| check | measured | profile | ratio | within 10 % |");
    println!("|---|---:|---:|---:|---|");
    for (name, measured, expected) in rows {
        let ratio = measured / expected;
        println!(
            "| {name} | {measured:.1} | {expected:.1} | {ratio:.3} | {} |",
            if (ratio - 1.0).abs() <= 0.10 {
                "yes"
            } else {
                "NO"
            }
        );
    }
}

fn body(prompt_len: u32, max_tokens: u32, salt: u32) -> serde_json::Value {
    let prompt: Vec<u32> = (0..prompt_len)
        .map(|k| 17 + (salt * 7919 + k) % 49_000)
        .collect();
    serde_json::json!({ "model": "m", "prompt": prompt, "max_tokens": max_tokens, "stream": true, "ignore_eos": true })
}

/// Sends one streamed request; returns the arrival times of its chunks, from the send.
async fn stream(client: &reqwest::Client, url: &str, body: &serde_json::Value) -> Vec<Duration> {
    let start = Instant::now();
    let mut resp = client
        .post(url)
        .json(body)
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut times = Vec::new();
    let mut sse = kvgate_protocol::sse::SseParser::default();
    while let Ok(Some(chunk)) = resp.chunk().await {
        let events = sse.push(&chunk).len();
        times.extend(std::iter::repeat_n(start.elapsed(), events));
    }
    times
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

async fn measure(port: u16, profile: &Profile) -> Vec<(&'static str, f64, f64)> {
    let client = reqwest::Client::new();
    let url = format!("http://127.0.0.1:{port}/v1/completions");
    for _ in 0..200 {
        if client
            .get(format!("http://127.0.0.1:{port}/health"))
            .send()
            .await
            .is_ok()
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut rows = Vec::new();

    // Single-stream decode: 256-token prompt, 300 tokens; median gap between tokens.
    let times = stream(&client, &url, &body(256, 300, 1)).await;
    let gaps: Vec<f64> = times
        .windows(2)
        .take(300)
        .map(|w| (w[1] - w[0]).as_secs_f64())
        .filter(|g| *g > 0.0)
        .collect();
    let measured = 1.0 / median(gaps);
    rows.push((
        "decode, 1 stream (tok/s)",
        measured,
        profile.decode_tokens_per_second(256 + 150),
    ));

    // Prefill: time to the first token of a 4,096-token prompt, median of 5 distinct prompts.
    let mut ttfts = Vec::new();
    for salt in 10..15 {
        let t = stream(&client, &url, &body(4096, 1, salt)).await;
        ttfts.push(t[0].as_secs_f64());
    }
    let expected = profile.step_seconds(std::iter::once((0, 4096)));
    rows.push((
        "prefill 4096 tokens (ms)",
        median(ttfts) * 1e3,
        expected * 1e3,
    ));

    // 32 concurrent streams: aggregate tokens per second in the steady middle of the run.
    let started = Instant::now();
    let tasks: Vec<_> = (0..32)
        .map(|i| {
            let (client, url) = (client.clone(), url.clone());
            tokio::spawn(async move { stream(&client, &url, &body(256, 400, 100 + i)).await })
        })
        .collect();
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap_or_default());
    }
    let _ = started;
    all.sort();
    let (lo, hi) = (all[all.len() / 4], all[all.len() * 3 / 4]);
    let in_window = all.iter().filter(|t| **t >= lo && **t < hi).count();
    let measured = in_window as f64 / (hi - lo).as_secs_f64();
    let step = profile.step_seconds((0..32).map(|_| (256 + 200, 1)));
    rows.push(("decode, 32 streams (tok/s)", measured, 32.0 / step));
    rows
}
