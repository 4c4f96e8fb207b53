//! Who gets in: the admin API behind its own token (secrets never shown), tenants identified
//! by API keys kept only as hashes, a class header honoured only where allowed, and each
//! tenant's limits (requests in flight, tokens per minute) answered with 429 and
//! `Retry-After`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use std::io::Write;
use std::process::Stdio;

/// `kvgate hash-key` on `key`.
fn hash_key(key: &str) -> String {
    let mut child = kvgate()
        .arg("hash-key")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    writeln!(child.stdin.take().unwrap(), "{key}").unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

#[test]
fn hash_key_hashes_stdin_and_generates_keys() {
    let hash = hash_key("sk-test");
    assert!(hash.starts_with("sha256:") && hash.len() == 71, "{hash}");
    assert_eq!(hash, hash_key("sk-test"));
    assert_ne!(hash, hash_key("sk-other"));
    let out = kvgate().args(["hash-key", "--generate"]).output().unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2, "{text}");
    assert!(lines[0].len() >= 64, "a long random key: {}", lines[0]);
    assert_eq!(lines[1], hash_key(lines[0]));
}

fn secret_file(name: &str, content: &str) -> tempfile::TempPath {
    temp_file_with(&format!("auth-{name}"), "", content)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_api_asks_for_its_token_and_shows_no_secret() {
    let w = Worker::start(&[]).await;
    let token = secret_file("admin-token", "adm1n-t0ken\n");
    let key_hash = hash_key("sk-secret-key");
    let extra = format!(
        "admin_token_file: \"{}\"\ntenants:\n  acme: {{api_keys: [\"{key_hash}\"]}}\n",
        token.display()
    );
    let (port, admin_port) = (free_port(), free_port());
    let config = temp_file_with(
        &format!("auth-{port}"),
        ".yaml",
        Gateway::yaml(port, admin_port, &[&w], &extra),
    );
    let mut cmd = kvgate();
    cmd.args(["gateway", "--config", config.to_str().unwrap()]);
    let _gw = spawn(cmd, &format!("gateway-{port}"));
    let admin = format!("http://127.0.0.1:{admin_port}");
    wait_ok(&format!("{admin}/health")).await;
    let get = |path: &str, auth: Option<&str>| {
        let mut r = client().get(format!("{admin}{path}"));
        if let Some(a) = auth {
            r = r.header("authorization", a);
        }
        r.send()
    };
    for path in ["/admin/replicas", "/admin/config"] {
        assert_eq!(get(path, None).await.unwrap().status(), 401, "{path}");
        let wrong = get(path, Some("Bearer adm1n-t0keX")).await.unwrap();
        assert_eq!(wrong.status(), 401, "{path}");
    }
    for path in ["/admin/reload", "/admin/explain"] {
        let r = client()
            .post(format!("{admin}{path}"))
            .body("{}")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 401, "{path}");
    }
    let ok = get("/admin/replicas", Some("Bearer adm1n-t0ken"))
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
    let config = get("/admin/config", Some("Bearer adm1n-t0ken"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(config.contains("<redacted>"), "{config}");
    assert!(!config.contains(&key_hash["sha256:".len()..]), "{config}");
    assert_eq!(get("/health", None).await.unwrap().status(), 200);
    assert_eq!(get("/metrics", None).await.unwrap().status(), 200);
}

const CLASSES: &str = "sla:\n  default_class: interactive\n  classes:\n    interactive: {priority: 5}\n    batch: {priority: 0}\n    gold: {priority: 9}\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_need_a_key_and_keep_to_their_classes() {
    let w = Worker::start(&[]).await;
    let extra = format!(
        "{CLASSES}tenants:\n  app: {{api_keys: [\"{}\"], allowed_classes: [batch]}}\n  jobs: {{api_keys: [\"{}\", \"{}\"], class: batch}}\n",
        hash_key("sk-app"),
        hash_key("sk-jobs-1"),
        hash_key("sk-jobs-2")
    );
    let gw = Gateway::start(&[&w], &extra).await;
    let ask = |key: Option<&str>, class: Option<&str>| {
        let mut r = client()
            .post(format!("{}/v1/completions", gw.url()))
            .json(&completion("hello", false));
        if let Some(k) = key {
            r = r.bearer_auth(k);
        }
        if let Some(c) = class {
            r = r.header("x-kvgate-class", c);
        }
        async move { r.send().await.unwrap().status().as_u16() }
    };
    assert_eq!(ask(None, None).await, 401, "no key");
    assert_eq!(ask(Some("sk-wrong"), None).await, 401, "unknown key");
    assert_eq!(ask(Some("sk-app"), None).await, 200);
    assert_eq!(
        ask(Some("sk-jobs-2"), None).await,
        200,
        "any of a tenant's keys"
    );
    assert_eq!(
        ask(Some("sk-app"), Some("batch")).await,
        200,
        "an allowed class"
    );
    assert_eq!(
        ask(Some("sk-app"), Some("gold")).await,
        403,
        "a class it may not take"
    );
    assert_eq!(ask(Some("sk-jobs-1"), Some("interactive")).await, 403);
    assert_eq!(ask(None, Some("gold")).await, 401);
    let metrics = gw.metrics().await;
    assert_eq!(
        metric(&metrics, "kvgate_unauthorized_total"),
        3.0,
        "{metrics}"
    );
    assert_eq!(
        metric(&metrics, "kvgate_tenant_requests_total{tenant=\"app\"}"),
        2.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_over_its_limits_gets_429_with_retry_after() {
    // Each answer takes 400 ms, so two requests overlap.
    let w = Worker::start(&["--first-token-delay-ms", "400"]).await;
    let extra = format!(
        "tenants:\n  one: {{api_keys: [\"{}\"], max_concurrent: 1}}\n  few: {{api_keys: [\"{}\"], tokens_per_minute: 120}}\n",
        hash_key("sk-one"),
        hash_key("sk-few")
    );
    let gw = Gateway::start(&[&w], &extra).await;
    let post = |key: &'static str, max_tokens: u32| {
        let url = gw.url();
        async move {
            let r = client()
                .post(format!("{url}/v1/completions"))
                .bearer_auth(key)
                .json(&serde_json::json!({ "model": MODEL, "prompt": "hi", "max_tokens": max_tokens }))
                .send()
                .await
                .unwrap();
            let retry = r
                .headers()
                .get("retry-after")
                .map(|v| v.to_str().unwrap().parse::<u64>().unwrap());
            (r.status().as_u16(), retry)
        }
    };
    let (a, b) = tokio::join!(post("sk-one", 4), async {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        post("sk-one", 4).await
    });
    assert_eq!(a.0, 200);
    assert_eq!(b, (429, Some(1)), "the second in flight");
    assert_eq!(post("sk-one", 4).await.0, 200, "the slot came back");

    // 120 tokens a minute, each request charged its prompt (1 token) plus max_tokens.
    assert_eq!(post("sk-few", 99).await.0, 200);
    let (status, retry) = post("sk-few", 60).await;
    assert_eq!(status, 429);
    assert!(
        retry.unwrap() >= 10,
        "about 40 tokens short at 2 a second: {retry:?}"
    );
    assert_eq!(
        post("sk-few", 500).await.0,
        400,
        "more than a minute's worth"
    );
    let metrics = gw.metrics().await;
    for series in [
        "kvgate_tenant_refused_total{limit=\"concurrency\",tenant=\"one\"}",
        "kvgate_tenant_refused_total{limit=\"tokens\",tenant=\"few\"}",
    ] {
        assert!(metric(&metrics, series) >= 1.0, "{series} in {metrics}");
    }
}

/// A client that waits for each answer never meets its own earlier request's slot: the slot
/// is free by the time the answer's last byte arrives (each request on a new connection, so
/// none waits for the gateway to finish with the one before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_one_at_a_time_never_meets_its_own_last_request() {
    let w = Worker::start(&[]).await;
    let extra = format!(
        "tenants:\n  one: {{api_keys: [\"{}\"], max_concurrent: 1}}\n",
        hash_key("sk-one")
    );
    let gw = Gateway::start(&[&w], &extra).await;
    for i in 0..200 {
        let stream = i % 2 == 1;
        let r = client()
            .post(format!("{}/v1/completions", gw.url()))
            .bearer_auth("sk-one")
            .json(&completion("hi", stream))
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        let body = r.text().await.unwrap();
        assert_eq!(status, 200, "request {i} (stream: {stream}): {body}");
    }
}

#[test]
fn keys_in_clear_are_refused_with_a_pointer_to_tenants() {
    let config = secret_file(
        "clear.yaml",
        "listen: \"127.0.0.1:1\"\nreplicas:\n  - url: \"http://127.0.0.1:2\"\nsla:\n  default_class: a\n  classes: {a: {}}\n  api_keys: {sk-live-123: a}\n",
    );
    let out = kvgate()
        .args(["check-config", config.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        said.contains("sla.api_keys") && said.contains("tenants"),
        "{said}"
    );
    assert!(!said.contains("sk-live-123"), "a key echoed: {said}");
}
