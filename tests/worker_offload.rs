//! The offload tier through the real worker binary: a prefix evicted from the KV cache and
//! asked for again is served from host memory (`usage` counts it cached, the answer is the
//! same, the host tier shows in `/stats` and in the KV events), and a tier the worker cannot
//! keep is refused at start with the reason.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use kvgate_protocol::kv_events::{KvEvent, KvEventBatch, Tier};
use std::time::Duration;

/// A 20-block cache (320 tokens) that the second prompt fills alone.
const CPU: [&str; 10] = [
    "--threads",
    "1",
    "--kv-cache-mib",
    "16",
    "--num-blocks",
    "20",
    "--max-model-len",
    "320",
    "--kv-offload-mib",
    "64",
];

fn prompt(seed: u32, len: u32) -> Vec<u32> {
    (0..len)
        .map(|i| 200 + (i * 31 + seed * 977) % 20_000)
        .collect()
}

async fn complete(w: &SimWorker, prompt: &[u32]) -> serde_json::Value {
    let body = serde_json::json!({"model": MODEL, "prompt": prompt, "max_tokens": 4,
        "temperature": 0, "logprobs": 1});
    let (status, r) = post(&w.url(), "/v1/completions", &body).await;
    assert_eq!(status, 200, "{r}");
    r
}

/// The blocks stored in `tier` among the events the worker has published so far.
async fn blocks_stored(url: &str, tier: Tier) -> usize {
    let mut resp = reqwest::Client::new()
        .get(format!("{url}/kv/events?from=1"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let (mut buf, mut stored) = (Vec::new(), 0);
    while let Ok(Ok(Some(chunk))) =
        tokio::time::timeout(Duration::from_millis(500), resp.chunk()).await
    {
        buf.extend_from_slice(&chunk);
        while let Some(nl) = buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = buf.drain(..=nl).collect();
            let batch: KvEventBatch = serde_json::from_slice(&line).unwrap();
            for e in batch.events {
                match e {
                    KvEvent::Stored {
                        hashes, tier: t, ..
                    } if t == tier => {
                        stored += hashes.len();
                    }
                    _ => {}
                }
            }
        }
    }
    stored
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evicted_prefix_is_served_from_the_host_tier() {
    let w = SimWorker::start_cpu(&CPU).await;
    let (a, b) = (prompt(1, 150), prompt(2, 310));
    let cached =
        |r: &serde_json::Value| r["usage"]["prompt_tokens_details"]["cached_tokens"].clone();
    let first = complete(&w, &a).await;
    assert_eq!(cached(&first), 0);
    complete(&w, &b).await;
    let again = complete(&w, &a).await;
    assert_eq!(cached(&again), 144, "its 9 full blocks, from the host tier");
    assert_eq!(
        again["choices"], first["choices"],
        "the same tokens and logprobs"
    );
    let offload = w.get("/stats").await["engine"]["offload"].clone();
    assert_eq!(offload["loaded_blocks"], 9, "{offload}");
    assert!(offload["capacity_bytes"] == 64 << 20, "{offload}");
    assert!(blocks_stored(&w.url(), Tier::Host).await >= 9);
}

/// With a host tier of two blocks over a disk tier, most of the evicted prefix comes back
/// from disk; the disk tier shows in `/stats`, `/metrics` and the KV events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evicted_prefix_is_served_from_the_disk_tier() {
    let dir = temp_dir("disk-tier");
    let mut flags = CPU.to_vec();
    flags[9] = "1"; // --kv-offload-mib: 2 blocks of 360 KiB
    let dir_arg = dir.path().to_str().unwrap();
    flags.extend(["--kv-offload-dir", dir_arg, "--kv-offload-disk-mib", "64"]);
    let w = SimWorker::start_cpu(&flags).await;
    let (a, b) = (prompt(1, 150), prompt(2, 310));
    let first = complete(&w, &a).await;
    complete(&w, &b).await;
    let again = complete(&w, &a).await;
    assert_eq!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"], 144,
        "{again}"
    );
    assert_eq!(again["choices"], first["choices"]);
    let offload = w.get("/stats").await["engine"]["offload"].clone();
    assert_eq!(offload["loaded_blocks"], 2, "{offload}");
    assert_eq!(offload["disk"]["loaded_blocks"], 7, "{offload}");
    assert!(offload["disk"]["load_cost"].as_f64().unwrap() < 1.0);
    assert!(blocks_stored(&w.url(), Tier::Disk).await >= 7);
    let metrics = w.metrics().await;
    assert!(
        metric(&metrics, "kvgate_worker_kv_disk_loaded_blocks_total") >= 7.0,
        "{metrics}"
    );
    let snapshot = w.get("/kv/snapshot").await;
    assert!(
        snapshot["disk_hashes"].as_array().unwrap().len() >= 7,
        "{snapshot}"
    );
    let mut w = w;
    w.proc.signal("TERM");
    assert!(w.proc.exits().success());
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|f| f.ok())
        .filter(|f| f.path().extension().is_some_and(|x| x == "kvblock"))
        .collect();
    assert!(
        left.is_empty(),
        "a stopped worker leaves no block files: {left:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Through an agent and a token-mode gateway: explain names the blocks a replica holds only in
/// its host tier apart from those on its device.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_explains_host_tier_blocks_apart() {
    let w = SimWorker::start_cpu(&CPU).await;
    let token = temp_file_with("offload-token", "", "offload-token");
    let model = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let yaml = format!(
        "agents:\n  token_file: \"{}\"\ntokenizers:\n  - model: {MODEL}\n    path: \"{}\"\n    block_size: 16\npolicy:\n  assumed_ttl_ms: 100\n",
        token.display(),
        model.display()
    );
    let gw = Gateway::start(&[&w], &yaml).await;
    let _agent = attach_agent(&gw, &token, &w, &[]);
    gw.wait_until(|rs| rs.iter().all(|r| r["freshness"] == "fresh"))
        .await;
    let (a, b) = (prompt(1, 150), prompt(2, 310));
    let body = |p: &[u32]| serde_json::json!({"model": MODEL, "prompt": p, "max_tokens": 4});
    for p in [&a, &b] {
        let answer = send(&client(), &gw.url(), "/v1/completions", &body(p)).await;
        assert_eq!(answer.status, 200, "{answer:?}");
    }
    let explain_a = || async {
        let r = client()
            .post(format!("{}/admin/explain", gw.admin()))
            .json(&body(&a))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        r.json::<serde_json::Value>().await.unwrap()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let e = explain_a().await;
        let held = &e["candidates"][0]["held_blocks"];
        if held["host"] == 9 {
            assert_eq!(held["device"], 0, "{e:#}");
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "prompt a's 9 blocks never showed in the host tier: {e:#}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[test]
fn a_tier_the_worker_cannot_keep_is_refused_at_start() {
    // A profile that names no device-host link: the sim backend has no price for a copy.
    let h200 = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("config/profiles/h200-llama-3.1-8b-bf16.yaml"),
    )
    .unwrap();
    let no_link: String = h200
        .lines()
        .filter(|l| !l.contains("host_link_gb_s"))
        .map(|l| format!("{l}\n"))
        .collect();
    let profile = temp_file_with("no-link", ".yaml", &no_link);
    let profile = profile.to_str().unwrap();
    let cases = [
        (
            "sim",
            vec!["--kv-offload-mib", "64", "--profile", profile],
            "hardware.host_link_gb_s",
        ),
        (
            "sim",
            vec![
                "--kv-offload-mib",
                "64",
                "--kv-offload-dir",
                "/tmp/kvgate-sim-disk",
            ],
            "without bytes to write",
        ),
        (
            "cpu",
            vec!["--kv-offload-mib", "64", "--no-prefix-caching"],
            "needs prefix caching",
        ),
        (
            "cpu",
            vec!["--kv-offload-dir", "/tmp/kvgate-no-host-tier"],
            "give --kv-offload-mib too",
        ),
        (
            "cpu",
            vec!["--kv-offload-mib", "8", "--kv-offload-dir", "/proc/kvgate"],
            "cannot create /proc/kvgate",
        ),
    ];
    for (backend, flags, expected) in cases {
        let port = free_port().to_string();
        let mut cmd = kvgate();
        cmd.args(["worker", "--backend", backend, "--port", &port])
            .args(["--kv-cache-mib", "64", "--max-model-len", "1024"])
            .args(&flags);
        let mut worker = spawn(cmd, &format!("offload-{backend}-{port}"));
        assert!(!worker.exits().success(), "{backend} {flags:?} started");
        let stderr = std::fs::read_to_string(&worker.log).unwrap();
        assert!(stderr.contains(expected), "{backend} {flags:?}: {stderr}");
    }
}
