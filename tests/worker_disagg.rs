//! Prefill/decode roles through the real worker binary, legs sent as a gateway sends them
//! (vLLM's `kv_transfer_params`): the decode worker's answer is the colocated worker's, its
//! prompt counted cached; a pull that cannot finish (a killed prefill worker, an unknown or
//! stale transfer, a corrupted, wrongly sized or silent prefill side) is computed instead,
//! with the same answer; no block or transfer is left held on either side.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use kvgate_protocol::{extend_block_hashes, HashSeed};
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// 150 tokens: 9 full blocks of 16 a decode worker can take.
fn prompt(seed: u32) -> Vec<u32> {
    prompt_ids(seed, 150)
}

fn body(prompt: &[u32]) -> Value {
    json!({"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 1})
}

async fn cpu_worker(role: Option<&str>, extra: &[&str]) -> SimWorker {
    let mut flags = CPU_SMALL_CONTEXT.to_vec();
    if let Some(role) = role {
        flags.extend(["--role", role]);
    }
    flags.extend(extra);
    SimWorker::start_cpu(&flags).await
}

async fn complete(w: &SimWorker, body: &Value) -> Value {
    let (status, r) = post(&w.url(), "/v1/completions", body).await;
    assert_eq!(status, 200, "{r}");
    r
}

/// The prefill leg: `max_tokens` 1 and a request for remote decode; its response's hand-over.
async fn prefill_leg(p: &SimWorker, prompt: &[u32]) -> Value {
    let mut leg = body(prompt);
    leg["max_tokens"] = json!(1);
    leg["kv_transfer_params"] = json!({"do_remote_decode": true});
    let r = complete(p, &leg).await;
    r["kv_transfer_params"].clone()
}

async fn decode_leg(d: &SimWorker, prompt: &[u32], params: Value) -> Value {
    let mut leg = body(prompt);
    leg["kv_transfer_params"] = params;
    complete(d, &leg).await
}

/// Every block back in the pool and no transfer waiting.
async fn nothing_held(w: &SimWorker) {
    let m = w.metrics().await;
    assert_eq!(metric(&m, "kvgate_worker_kv_blocks_used"), 0.0, "{m}");
    assert_eq!(metric(&m, "kvgate_worker_kv_transfers_waiting"), 0.0, "{m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_then_decode_answers_as_one_worker_does() {
    let (colocated, p, d) = tokio::join!(
        cpu_worker(None, &[]),
        cpu_worker(Some("prefill"), &[]),
        cpu_worker(Some("decode"), &[])
    );
    let a = prompt(1);
    let reference = complete(&colocated, &body(&a)).await;
    let params = prefill_leg(&p, &a).await;
    assert_eq!(params["do_remote_prefill"], true, "{params}");
    assert_eq!(params["remote_block_count"], 9, "{params}");
    let answer = decode_leg(&d, &a, params.clone()).await;
    assert_eq!(
        answer["choices"], reference["choices"],
        "same tokens, same logprobs"
    );
    assert_eq!(
        cached_tokens(&answer),
        144,
        "the 9 pulled blocks count as cached"
    );
    let offload = d.get("/stats").await["engine"]["offload"].clone();
    assert_eq!(offload["imported_blocks"], 9, "{offload}");
    assert_eq!(offload["loaded_blocks"], 9, "{offload}");
    let received = r#"kvgate_worker_kv_transfer_blocks_total{direction="received"}"#;
    assert_eq!(metric(&d.metrics().await, received), 9.0);
    let offered = r#"kvgate_worker_kv_transfer_blocks_total{direction="offered"}"#;
    assert_eq!(metric(&p.metrics().await, offered), 9.0);
    nothing_held(&p).await;
    nothing_held(&d).await;

    // The same transfer again is stale (pulled once): computed, same answer.
    let b = prompt(2);
    let reference = complete(&colocated, &body(&b)).await;
    let answer = decode_leg(&d, &b, params).await;
    assert_eq!(answer["choices"], reference["choices"]);
    assert_eq!(cached_tokens(&answer), 0);
    let stale = r#"kvgate_worker_kv_transfer_failures_total{reason="unknown_transfer"}"#;
    assert_eq!(metric(&d.metrics().await, stale), 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_worker_killed_before_the_pull_costs_a_recompute_only() {
    let (colocated, mut p, d) = tokio::join!(
        cpu_worker(None, &[]),
        cpu_worker(Some("both"), &[]),
        cpu_worker(Some("decode"), &[])
    );
    let a = prompt(3);
    let reference = complete(&colocated, &body(&a)).await;
    let params = prefill_leg(&p, &a).await;
    p.proc.kill();
    let answer = decode_leg(&d, &a, params).await;
    assert_eq!(answer["choices"], reference["choices"]);
    assert_eq!(cached_tokens(&answer), 0);
    let m = d.metrics().await;
    let unreachable = r#"kvgate_worker_kv_transfer_failures_total{reason="unreachable"}"#;
    assert_eq!(metric(&m, unreachable), 1.0, "{m}");
    // A host that does not resolve costs the same, within the deadline.
    let params = json!({"do_remote_prefill": true, "remote_host": "kvgate-no-such-host.invalid",
        "remote_port": 1, "transfer_id": "00000000000000ff"});
    let answer = decode_leg(&d, &a, params).await;
    assert_eq!(answer["choices"], reference["choices"]);
    assert_eq!(metric(&d.metrics().await, unreachable), 2.0);
    nothing_held(&d).await;
}

/// A prefill side played by the test: it offers `chain`, reads what is wanted, and sends
/// each block as `block(i)` makes it (hash, bytes, checksum), or stays silent.
async fn scripted_prefill(
    chain: Vec<u64>,
    block: impl Fn(usize, u64) -> Option<(u64, Vec<u8>, u64)> + Send + 'static,
) -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut request = [0u8; 12];
        s.read_exact(&mut request).await.unwrap();
        assert_eq!(&request[..4], b"KVT1");
        let mut offer = vec![0u8];
        offer.extend((chain.len() as u32).to_be_bytes());
        chain.iter().for_each(|h| offer.extend(h.to_be_bytes()));
        s.write_all(&offer).await.unwrap();
        let k = s.read_u32().await.unwrap();
        for _ in 0..k {
            let i = s.read_u32().await.unwrap() as usize;
            let Some((hash, data, sum)) = block(i, chain[i]) else {
                tokio::time::sleep(Duration::from_secs(60)).await;
                return;
            };
            let mut out = hash.to_be_bytes().to_vec();
            out.extend((data.len() as u32).to_be_bytes());
            out.extend(sum.to_be_bytes());
            out.extend(data);
            s.write_all(&out).await.unwrap();
        }
    });
    port
}

fn chain(prompt: &[u32]) -> Vec<u64> {
    let mut hashes = Vec::new();
    extend_block_hashes(HashSeed::new(MODEL, None, ""), prompt, 16, &mut hashes);
    hashes.truncate((prompt.len() - 1) / 16);
    hashes
}

fn from(port: u16) -> Value {
    json!({"do_remote_prefill": true, "remote_host": "127.0.0.1", "remote_port": port,
        "transfer_id": "00000000000000ff"})
}

/// One block of SmolLM2's K/V on the cpu backend: 30 layers, K and V, 3 heads of 64, 16
/// tokens, f16.
const BLOCK_BYTES: usize = 30 * 2 * 3 * 64 * 16 * 2;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupted_wrongly_sized_or_silent_transfers_are_computed_instead() {
    let (colocated, d) = tokio::join!(
        cpu_worker(None, &[]),
        cpu_worker(Some("decode"), &["--kv-transfer-timeout-ms", "500"])
    );
    let checksum = |data: &[u8]| xxhash_rust::xxh3::xxh3_64(data);
    type Script = Box<dyn Fn(usize, u64) -> Option<(u64, Vec<u8>, u64)> + Send>;
    let cases: [(&str, Script); 3] = [
        (
            "checksum",
            Box::new(move |_, hash| {
                let data = vec![1u8; BLOCK_BYTES];
                Some((hash, data, 12345))
            }),
        ),
        (
            "wrong_size",
            Box::new(move |_, hash| {
                let data = vec![1u8; 100];
                let sum = checksum(&data);
                Some((hash, data, sum))
            }),
        ),
        ("deadline", Box::new(|_, _| None)),
    ];
    for (seed, (reason, script)) in (10..).zip(cases) {
        let p = prompt(seed);
        let reference = complete(&colocated, &body(&p)).await;
        let port = scripted_prefill(chain(&p), script).await;
        let started = Instant::now();
        let answer = decode_leg(&d, &p, from(port)).await;
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{reason}: the decode worker waited past its deadline"
        );
        assert_eq!(answer["choices"], reference["choices"], "{reason}");
        assert_eq!(
            cached_tokens(&answer),
            0,
            "{reason}: nothing wrong is served"
        );
        let series = format!("kvgate_worker_kv_transfer_failures_total{{reason=\"{reason}\"}}");
        assert_eq!(metric(&d.metrics().await, &series), 1.0, "{reason}");
    }
    nothing_held(&d).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn legs_a_worker_cannot_serve_are_refused_with_the_reason() {
    let (plain, p, d) = tokio::join!(
        SimWorker::start(&[]),
        SimWorker::start(&["--role", "prefill"]),
        SimWorker::start(&["--role", "decode", "--kv-offload-mib", "64"])
    );
    let a = prompt(4);
    let mut prefill = body(&a);
    prefill["kv_transfer_params"] = json!({"do_remote_decode": true});
    let (status, r) = post(&plain.url(), "/v1/completions", &prefill).await;
    assert_eq!(status, 400, "{r}");
    assert!(
        r["error"]["message"].as_str().unwrap().contains("--role"),
        "{r}"
    );
    prefill["stream"] = json!(true);
    let (status, r) = post(&p.url(), "/v1/completions", &prefill).await;
    assert_eq!(status, 400, "{r}");
    assert_eq!(r["error"]["param"], "kv_transfer_params", "{r}");
    let mut decode = body(&a);
    decode["kv_transfer_params"] = json!({"do_remote_prefill": true, "remote_port": 1});
    let (status, r) = post(&d.url(), "/v1/completions", &decode).await;
    assert_eq!(status, 400, "{r}");
    assert!(
        r["error"]["message"]
            .as_str()
            .unwrap()
            .contains("remote_host"),
        "{r}"
    );
    let (status, r) = post(&p.url(), "/v1/completions", &decode).await;
    assert_eq!(status, 400, "a prefill-only worker pulls nothing: {r}");
}

/// The sim backend's blocks hold no bytes: the transfer carries their hashes, and the decode
/// worker prices the copy by its profile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sim_workers_hand_over_prompts_too() {
    let (p, d) = tokio::join!(
        SimWorker::start(&["--role", "prefill"]),
        SimWorker::start(&["--role", "decode"])
    );
    let a = prompt(5);
    let params = prefill_leg(&p, &a).await;
    let answer = decode_leg(&d, &a, params).await;
    assert_eq!(cached_tokens(&answer), 144, "{answer}");
    nothing_held(&p).await;
    nothing_held(&d).await;
}

/// The HTTP port is bound before the transfer listener, so a transfer listener on port 0 can
/// never be given the worker's own HTTP port (it was, now and then, under parallel tests).
/// With both asked for the same port, the transfer listener is the one that cannot have it.
#[test]
fn the_http_port_is_taken_before_the_transfer_port() {
    let port = free_port().to_string();
    let out = kvgate()
        .args(["worker", "--backend", "sim", "--served-model-name", MODEL])
        .args([
            "--role",
            "prefill",
            "--port",
            &port,
            "--kv-transfer-port",
            &port,
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains(&format!(
            "cannot listen for block transfers on 127.0.0.1:{port}"
        )),
        "{stderr}"
    );
}
