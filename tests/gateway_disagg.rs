//! Prefill/decode pools at the gateway, on real workers: vLLM's flow through kvgate's own
//! prefill and decode workers answers as one worker does; a dead prefill replica is passed
//! over, a dead prefill pool leaves the prompt to the decode replica; short prompts skip the
//! prefill leg; SGLang's flow sends one body, with a bootstrap address and a fresh room, to a
//! prefill and a decode replica (recorded by fault-injection workers).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

const PREFILL: &str = "{prefill: \"yes\"}";
const DECODE: &str = "{decode: \"yes\"}";

/// A gateway over `replicas` (each with its labels, YAML flow style) and one pool.
async fn gateway(replicas: &[(&dyn Upstream, &str)], pool: &str) -> Gateway {
    let (port, admin_port) = (free_port(), free_port());
    let mut yaml = format!(
        "listen: \"127.0.0.1:{port}\"\nadmin_listen: \"127.0.0.1:{admin_port}\"\nhealth:\n  interval_ms: 200\n  ejection_base_ms: 500\nreplicas:\n"
    );
    for (w, labels) in replicas {
        yaml.push_str(&format!(
            "  - url: \"{}\"\n    id: \"{}\"\n    labels: {labels}\n",
            w.url(),
            w.id()
        ));
    }
    yaml.push_str(&format!(
        "disaggregation:\n  pools:\n    - prefill: {PREFILL}\n      decode: {DECODE}\n{pool}"
    ));
    Gateway::start_config(port, admin_port, yaml).await
}

fn body(prompt: &[u32]) -> Value {
    json!({"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 1})
}

async fn pd_requests(gw: &Gateway, flow: &str, path: &str) -> f64 {
    let m = gw.metrics().await;
    let series = format!("kvgate_pd_requests_total{{flow=\"{flow}\",path=\"{path}\"}}");
    metric(&m, &series)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_flow_answers_as_one_worker_does() {
    let with_role = |r: &'static str| [&CPU_SMALL_CONTEXT[..], &["--role", r]].concat();
    let (prefill, decode) = (with_role("prefill"), with_role("decode"));
    let (colocated, p, d) = tokio::join!(
        SimWorker::start_cpu(&CPU_SMALL_CONTEXT),
        SimWorker::start_cpu(&prefill),
        SimWorker::start_cpu(&decode)
    );
    let gw = gateway(&[(&p, PREFILL), (&d, DECODE)], "      flow: vllm\n").await;
    let a = prompt_ids(1, 150);
    let (_, reference) = post(&colocated.url(), "/v1/completions", &body(&a)).await;
    let (status, answer) = post(&gw.url(), "/v1/completions", &body(&a)).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(
        answer["choices"], reference["choices"],
        "same tokens, same logprobs"
    );
    assert_eq!(
        cached_tokens(&answer),
        144,
        "the prompt came from the prefill replica"
    );
    assert_eq!(
        answer.get("kv_transfer_params"),
        None,
        "the client sees the decode leg"
    );

    let b = prompt_ids(2, 150);
    let (_, reference) = post(&colocated.url(), "/v1/completions", &body(&b)).await;
    let mut streamed = body(&b);
    streamed["stream"] = json!(true);
    let answer = send(&client(), &gw.url(), "/v1/completions", &streamed).await;
    assert_eq!(answer.status, 200);
    assert!(answer.done && !answer.stream_error);
    assert_eq!(
        answer.text,
        reference["choices"][0]["text"].as_str().unwrap()
    );
    assert_eq!(
        answer.replica,
        Some(Upstream::id(&d)),
        "the decode replica streams"
    );
    assert_eq!(pd_requests(&gw, "vllm", "prefill_decode").await, 2.0);

    // Explain ranks each leg within its phase.
    let explained: Value = client()
        .post(format!("{}/admin/explain", gw.admin()))
        .json(&body(&a))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let names = |leg: &str| -> Vec<Value> {
        let candidates = explained[leg]["candidates"].as_array().unwrap();
        candidates.iter().map(|c| c["replica"].clone()).collect()
    };
    assert_eq!(names("prefill"), [json!(Upstream::id(&p))], "{explained:#}");
    assert_eq!(names("decode"), [json!(Upstream::id(&d))], "{explained:#}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_prefill_replica_is_passed_over_and_a_dead_pool_leaves_the_prompt_to_decode() {
    let (mut p1, mut p2, d) = tokio::join!(
        SimWorker::start(&["--role", "prefill"]),
        SimWorker::start(&["--role", "prefill"]),
        SimWorker::start(&["--role", "decode"])
    );
    let gw = gateway(
        &[(&p1, PREFILL), (&p2, PREFILL), (&d, DECODE)],
        "      flow: vllm\n",
    )
    .await;
    p1.proc.kill();
    for seed in 0..4 {
        let (status, answer) =
            post(&gw.url(), "/v1/completions", &body(&prompt_ids(seed, 150))).await;
        assert_eq!(status, 200, "{answer}");
        assert_eq!(
            cached_tokens(&answer),
            144,
            "the live prefill replica took it: {answer}"
        );
    }
    p2.proc.kill();
    let (status, answer) = post(&gw.url(), "/v1/completions", &body(&prompt_ids(9, 150))).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(cached_tokens(&answer), 0, "computed by the decode replica");
    assert_eq!(pd_requests(&gw, "vllm", "fallback").await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_prompts_skip_the_prefill_leg_and_refusals_pass_through() {
    let (p, d) = tokio::join!(
        SimWorker::start(&["--role", "prefill"]),
        SimWorker::start(&["--role", "decode"])
    );
    let pool = "      flow: vllm\n      min_prompt_tokens: 100\n";
    let gw = gateway(&[(&p, PREFILL), (&d, DECODE)], pool).await;
    let (status, answer) = post(&gw.url(), "/v1/completions", &body(&prompt_ids(1, 20))).await;
    assert_eq!(status, 200, "{answer}");
    let requests = metric(&p.metrics().await, "kvgate_worker_requests_total");
    assert_eq!(requests, 0.0, "no prefill leg for a short prompt");
    assert_eq!(pd_requests(&gw, "vllm", "decode_only").await, 1.0);
    // A client's own hand-over never reaches a replica: none pulls from where it says.
    let mut forged = body(&prompt_ids(3, 20));
    forged["kv_transfer_params"] = json!({"do_remote_prefill": true,
        "remote_host": "127.0.0.1", "remote_port": free_port(), "transfer_id": "00000000000000ff"});
    let (status, answer) = post(&gw.url(), "/v1/completions", &forged).await;
    assert_eq!(status, 200, "{answer}");
    let m = d.metrics().await;
    let unreachable = r#"kvgate_worker_kv_transfer_failures_total{reason="unreachable"}"#;
    assert_eq!(metric(&m, unreachable), 0.0, "{m}");
    let mut refused = body(&prompt_ids(2, 150));
    refused["echo"] = json!(true);
    let (status, answer) = post(&gw.url(), "/v1/completions", &refused).await;
    assert_eq!(status, 400, "{answer}");
    assert!(
        answer["error"]["message"]
            .as_str()
            .unwrap()
            .contains("echo"),
        "the prefill replica's reason: {answer}"
    );
}

/// The body a fault-injection worker received last (waiting for it, for a leg sent
/// in the background).
async fn last_received(w: &Worker, count: usize) -> Value {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let received = get_json(&format!("{}/received", w.url())).await;
        let list = received.as_array().unwrap();
        if list.len() >= count {
            return list[count - 1].clone();
        }
        assert!(Instant::now() < deadline, "{} received {received}", w.id());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_flow_sends_one_body_with_a_bootstrap_room_to_both() {
    let (p, d) = tokio::join!(Worker::start(&[]), Worker::start(&[]));
    let prefill_labels = "{prefill: \"yes\", bootstrap_port: \"9100\"}";
    let gw = gateway(
        &[(&p, prefill_labels), (&d, DECODE)],
        "      flow: sglang\n",
    )
    .await;
    let sent = chat("hello there", false);
    let mut rooms = Vec::new();
    for i in 1..=2 {
        let answer = send(&client(), &gw.url(), "/v1/chat/completions", &sent).await;
        assert_eq!(answer.status, 200);
        assert_eq!(
            answer.replica,
            Some(d.id()),
            "the client gets the decode answer"
        );
        let (to_prefill, to_decode) = (last_received(&p, i).await, last_received(&d, i).await);
        assert_eq!(to_prefill, to_decode, "one body to both");
        assert_eq!(to_decode["bootstrap_host"], "127.0.0.1");
        assert_eq!(to_decode["bootstrap_port"], 9100);
        let room = to_decode["bootstrap_room"].as_u64().unwrap();
        assert!(room < 1 << 63);
        rooms.push(room);
        let mut rest = to_decode.clone();
        for field in ["bootstrap_host", "bootstrap_port", "bootstrap_room"] {
            rest.as_object_mut().unwrap().remove(field);
        }
        assert_eq!(rest, sent, "nothing else changed");
    }
    assert_ne!(rooms[0], rooms[1], "a fresh room per request");
    assert_eq!(pd_requests(&gw, "sglang", "prefill_decode").await, 2.0);
}
