//! Speculative decoding through the real worker binary: the same answers with it as without
//! (greedy, seeded sampling, stop strings, logprobs), vLLM's counters in `/metrics`, and every
//! bad speculation flag refused at start with a clear error.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;

const GROUNDED: &str = "Repeat the following list exactly, one item per line:\napple\nbanana\ncherry\ndate\nelderberry\nfig\ngrape";

/// A small CPU worker: one thread, a cache for one 1k-token request.
const CPU: [&str; 6] = [
    "--threads",
    "1",
    "--kv-cache-mib",
    "64",
    "--max-model-len",
    "1024",
];

fn request(extra: serde_json::Value) -> serde_json::Value {
    let mut body = serde_json::json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": GROUNDED}],
        "max_tokens": 48,
        "temperature": 0,
    });
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_speculative_worker_answers_as_a_plain_one() {
    let plain = SimWorker::start_cpu(&CPU).await;
    let fast = SimWorker::start_cpu(&[&CPU[..], &["--spec-method", "ngram"]].concat()).await;
    let cases = [
        serde_json::json!({}),
        serde_json::json!({"temperature": 0.8, "top_p": 0.9, "seed": 7}),
        serde_json::json!({"stop": ["cherry"]}),
        serde_json::json!({"logprobs": true, "top_logprobs": 2, "max_tokens": 12}),
        serde_json::json!({"max_tokens": 5}),
    ];
    for case in cases {
        let body = request(case.clone());
        let (s1, a) = post(&plain.url(), "/v1/chat/completions", &body).await;
        let (s2, b) = post(&fast.url(), "/v1/chat/completions", &body).await;
        assert_eq!((s1, s2), (200, 200), "{a} {b}");
        assert_eq!(a["choices"], b["choices"], "{case}");
        assert_eq!(a["usage"], b["usage"], "{case}");
    }
    let stats = fast.get("/stats").await;
    eprintln!("speculation on this machine: {}", stats["engine"]["spec"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drafts_are_counted_in_vllms_metrics() {
    let w = SimWorker::start(&["--time-scale", "0.001", "--spec-method", "suffix"]).await;
    // The same request twice: the second drafts the first one's answer from the suffix cache,
    // and the sim model, deterministic, keeps it.
    let prompt: Vec<u32> = (0..96).map(|i| 200 + i).collect();
    let body =
        serde_json::json!({"model": MODEL, "prompt": prompt, "max_tokens": 16, "ignore_eos": true});
    for _ in 0..2 {
        let (s, r) = post(&w.url(), "/v1/completions", &body).await;
        assert_eq!(s, 200, "{r}");
    }
    let metrics = w.metrics().await;
    let drafts = metric(&metrics, "vllm:spec_decode_num_drafts_total");
    assert!(drafts > 0.0, "{metrics}");
    assert_eq!(
        drafts,
        metric(&metrics, "kvgate_worker_spec_decode_drafts_total")
    );
    let drafted = metric(&metrics, "vllm:spec_decode_num_draft_tokens_total");
    let accepted = metric(&metrics, "vllm:spec_decode_num_accepted_tokens_total");
    assert!(
        drafted >= drafts && accepted > 0.0 && accepted <= drafted,
        "{metrics}"
    );
    assert!(metric(&metrics, "kvgate_worker_spec_decode_mean_acceptance_length") > 1.0);
    assert!(metrics.contains("vllm:spec_decode_num_accepted_tokens_per_pos_total{position=\"0\"}"));
    let stats = w.get("/stats").await;
    assert_eq!(stats["engine"]["spec"]["drafts"].as_f64(), Some(drafts));
}

#[test]
fn bad_speculation_flags_are_refused_at_start() {
    let cases: [(&[&str], &str); 6] = [
        (
            &["--spec-method", "ngram", "--spec-tokens", "0"],
            "between 1 and 16, got 0",
        ),
        (
            &["--spec-method", "ngram", "--spec-tokens", "17"],
            "between 1 and 16, got 17",
        ),
        (
            &[
                "--spec-method",
                "ngram",
                "--spec-ngram-min",
                "5",
                "--spec-ngram-max",
                "3",
            ],
            "min 5, max 3",
        ),
        (&["--spec-method", "draft"], "needs --spec-draft-model"),
        (
            &["--spec-draft-model", "x.gguf"],
            "needs --spec-method draft",
        ),
        (
            &["--spec-method", "suffix", "--spec-suffix-entries", "0"],
            "at least 1",
        ),
    ];
    for (flags, expected) in cases {
        for command in [&["worker", "--port", "1"][..], &["up"][..]] {
            let out = kvgate().args(command).args(flags).output().unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{command:?} {flags:?} started");
            assert!(stderr.contains(expected), "{command:?} {flags:?}: {stderr}");
        }
    }
}
