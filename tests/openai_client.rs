//! The official OpenAI Python client (PyPI `openai`) through the gateway.
//! Needs a Python with `openai` installed: `KVGATE_PYTHON` names it (the test command sets it
//! up in `.venv`). Without one the test says so loudly and passes only if
//! `KVGATE_REQUIRE_PYTHON` is unset; CI sets it, so there it fails instead.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;

/// A Python with `openai`, or `None` after saying loudly that the test is skipped (and failing
/// instead when `KVGATE_REQUIRE_PYTHON` is set).
fn python() -> Option<String> {
    let candidate = std::env::var("KVGATE_PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = std::process::Command::new(&candidate)
        .args(["-c", "import openai"])
        .output()
        .is_ok_and(|o| o.status.success());
    if ok {
        return Some(candidate);
    }
    let msg =
        "SKIPPED: no Python with the `openai` package (set KVGATE_PYTHON; `scripts/test` does)";
    assert!(std::env::var_os("KVGATE_REQUIRE_PYTHON").is_none(), "{msg}");
    eprintln!("\n\n*** {msg} ***\n\n");
    None
}

async fn run_script(python: &str, script: &str, args: &[&str]) {
    let script = format!("{}/tests/python/{script}", env!("CARGO_MANIFEST_DIR"));
    let out = tokio::process::Command::new(python)
        .arg(script)
        .args(args)
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "stdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_openai_client_works_through_the_gateway() {
    let Some(python) = python() else { return };
    let (a, b) = (Worker::start(&[]).await, Worker::start(&[]).await);
    let gw = Gateway::start(&[&a, &b], "").await;
    run_script(&python, "openai_client.py", &[&gw.url(), MODEL]).await;
}

/// The bar: through the gateway, the official client's greedy chat answer from a real
/// CPU worker equals llama.cpp's for the GGUF's own chat template (golden case 0, recorded by
/// `worker/tests/golden/record_logits.py`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_greedy_chat_through_the_gateway_equals_llama_cpp() {
    let Some(python) = python() else { return };
    let golden: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/worker/tests/golden/reference.json"
        ))
        .unwrap(),
    )
    .unwrap();
    let case = &golden["cases"][0];
    assert_eq!(case["kind"], "chat");
    let worker = SimWorker::start_cpu(&["--threads", "1"]).await;
    let gw = Gateway::start(&[&worker], "").await;
    let question = case["text"].as_str().unwrap();
    let expected = case["greedy_text"].as_str().unwrap();
    run_script(
        &python,
        "openai_greedy.py",
        &[&gw.url(), MODEL, question, expected],
    )
    .await;
}
