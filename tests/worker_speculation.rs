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
    let cut = cut_model(2);
    let cut_path = cut.display().to_string();
    let draft = ["--spec-method", "draft", "--spec-draft-model", &cut_path];
    let fast = [
        (
            "ngram",
            SimWorker::start_cpu(&[&CPU[..], &["--spec-method", "ngram"]].concat()).await,
        ),
        (
            "draft",
            SimWorker::start_cpu(&[&CPU[..], &draft].concat()).await,
        ),
    ];
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
        for (method, fast) in &fast {
            let (s2, b) = post(&fast.url(), "/v1/chat/completions", &body).await;
            assert_eq!((s1, s2), (200, 200), "{a} {b}");
            assert_eq!(a["choices"], b["choices"], "{method}: {case}");
            assert_eq!(a["usage"], b["usage"], "{method}: {case}");
        }
    }
    for (_, fast) in &fast {
        let stats = fast.get("/stats").await;
        eprintln!("speculation on this machine: {}", stats["engine"]["spec"]);
    }
}

/// The default model cut to its first `layers` layers, in a file removed when dropped.
fn cut_model(layers: usize) -> tempfile::TempPath {
    let model = temp_file(&format!("cut-{layers}"), ".gguf").into_temp_path();
    kvgate_worker::model::cut_layers(&default_model(), &model, layers).unwrap();
    model
}

fn default_model() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models/SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// A worker whose backend cannot run its drafter (a draft model it cannot use, modelled drafts
/// on a real backend, a draft model on the sim backend) stops at start, saying why.
#[test]
fn a_drafter_the_backend_cannot_run_stops_the_worker_at_start() {
    let other_vocabulary = temp_file("vocab", ".gguf").into_temp_path();
    kvgate_worker::model::rewrite(&default_model(), &other_vocabulary, |g| {
        let size = kvgate_worker::model::gguf::Value::U32(32_000);
        g.metadata.insert("llama.vocab_size".into(), size);
        Ok(())
    })
    .unwrap();
    let vocab = other_vocabulary.display().to_string();
    let draft =
        |model: &str| ["--spec-method", "draft", "--spec-draft-model", model].map(String::from);
    let modelled = ["--spec-method", "sim", "--spec-acceptance", "0.5"].map(String::from);
    let cases = [
        ("cpu", draft("/nonexistent/draft.gguf"), "cannot read"),
        (
            "cpu",
            draft(&vocab),
            "vocabulary has 32000 tokens, the target's 49152",
        ),
        ("sim", draft(&vocab), "cannot run a draft model"),
        ("cpu", modelled, "need the sim backend"),
    ];
    for (backend, flags, expected) in cases {
        let port = free_port().to_string();
        let mut cmd = kvgate();
        cmd.args(["worker", "--backend", backend, "--port", &port])
            .args(CPU)
            .args(&flags);
        let name = format!("drafter-{backend}-{port}");
        let mut worker = spawn(cmd, &name);
        assert!(!worker.exits().success(), "{backend} {flags:?} started");
        let stderr = std::fs::read_to_string(&worker.log).unwrap();
        assert!(stderr.contains(expected), "{backend} {flags:?}: {stderr}");
    }
}

/// The sim backend's modelled drafts: a workload's acceptance, the same tokens as without.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn modelled_drafts_keep_their_acceptance_and_change_no_token() {
    let plain = SimWorker::start(&["--time-scale", "0.001"]).await;
    let flags = |acceptance: &'static str| {
        [
            "--time-scale",
            "0.001",
            "--spec-method",
            "sim",
            "--spec-acceptance",
            acceptance,
        ]
    };
    let (always, never) = (
        SimWorker::start(&flags("1")).await,
        SimWorker::start(&flags("0")).await,
    );
    let prompt: Vec<u32> = (0..40).map(|i| 300 + i).collect();
    let body =
        serde_json::json!({"model": MODEL, "prompt": prompt, "max_tokens": 40, "ignore_eos": true});
    let (_, expected) = post(&plain.url(), "/v1/completions", &body).await;
    for w in [&always, &never] {
        let (s, r) = post(&w.url(), "/v1/completions", &body).await;
        assert_eq!(s, 200, "{r}");
        assert_eq!(r["choices"], expected["choices"]);
    }
    let counts = |m: &str| {
        (
            metric(m, "vllm:spec_decode_num_draft_tokens_total"),
            metric(m, "vllm:spec_decode_num_accepted_tokens_total"),
        )
    };
    let (drafted, kept) = counts(&always.metrics().await);
    assert!(drafted > 0.0 && kept == drafted, "{drafted} {kept}");
    let (drafted, kept) = counts(&never.metrics().await);
    assert!(kept == 0.0, "{drafted} {kept}");
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
    let cases: [(&[&str], &str); 9] = [
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
        (&["--spec-method", "sim"], "needs --spec-acceptance"),
        (
            &["--spec-method", "sim", "--spec-acceptance", "1.5"],
            "between 0 and 1, got 1.5",
        ),
        (
            &["--spec-method", "ngram", "--spec-acceptance", "0.5"],
            "needs --spec-method sim",
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
