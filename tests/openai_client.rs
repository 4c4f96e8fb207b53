//! The official OpenAI Python client (PyPI `openai`) through the gateway.
//! Needs a Python with `openai` installed: `KVGATE_PYTHON` names it (the test command sets it
//! up in `.venv`). Without one the test says so loudly and passes only if
//! `KVGATE_REQUIRE_PYTHON` is unset; CI sets it, so there it fails instead.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;

fn python() -> Option<String> {
    let candidate = std::env::var("KVGATE_PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = std::process::Command::new(&candidate)
        .args(["-c", "import openai"])
        .output()
        .is_ok_and(|o| o.status.success());
    ok.then_some(candidate)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_openai_client_works_through_the_gateway() {
    let Some(python) = python() else {
        let msg =
            "SKIPPED: no Python with the `openai` package (set KVGATE_PYTHON; `scripts/test` does)";
        assert!(std::env::var_os("KVGATE_REQUIRE_PYTHON").is_none(), "{msg}");
        eprintln!("\n\n*** {msg} ***\n\n");
        return;
    };
    let (a, b) = (Worker::start(&[]).await, Worker::start(&[]).await);
    let gw = Gateway::start(&[&a, &b], "").await;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/openai_client.py");
    let out = tokio::process::Command::new(python)
        .args([script, &gw.url(), MODEL])
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
