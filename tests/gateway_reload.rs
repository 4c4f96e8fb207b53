//! Live reload: SIGHUP and the admin API, under load and with broken configs.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reload_under_load_fails_no_request() {
    let delay = ["--token-delay-ms", "5"];
    let (a, b, c) = (
        Worker::start(&delay).await,
        Worker::start(&delay).await,
        Worker::start(&delay).await,
    );
    let gw = Gateway::start(&[&a, &b], "").await;
    let client = client();
    let tasks: Vec<_> = (0..8)
        .map(|t| {
            let (client, url) = (client.clone(), gw.url());
            tokio::spawn(async move {
                for i in 0..40 {
                    let content = format!("reload {t} {i} alpha beta gamma");
                    let body = if i % 2 == 0 {
                        chat(&content, true)
                    } else {
                        completion(&content, false)
                    };
                    let path = if i % 2 == 0 {
                        "/v1/chat/completions"
                    } else {
                        "/v1/completions"
                    };
                    let answer = send(&client, &url, path, &body).await;
                    assert_eq!(answer.status, 200, "{answer:?}");
                    assert_eq!(answer.text, content);
                    assert!(!answer.stream_error);
                }
            })
        })
        .collect();
    // Alternate between two fleets and two policies while the load runs.
    let two = Gateway::yaml(gw.port, gw.admin_port, &[&a, &b], "");
    let three = Gateway::yaml(
        gw.port,
        gw.admin_port,
        &[&a, &b, &c],
        "policy:\n  weights: {prefix: 1.0, ring: 2.0}\n",
    );
    for round in 0..6 {
        std::fs::write(&gw.config, if round % 2 == 0 { &three } else { &two }).unwrap();
        gw.proc.signal("HUP");
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    for t in tasks {
        t.await.unwrap();
    }
    // The last write (round 5) was the two-replica fleet.
    gw.wait_until(|r| r.len() == 2).await;
    assert!(gw
        .metrics()
        .await
        .contains("kvgate_config_reloads_total{result=\"success\"} 6"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_config_is_rejected_and_the_running_one_kept() {
    let (a, b) = (Worker::start(&[]).await, Worker::start(&[]).await);
    let gw = Gateway::start(&[&a, &b], "").await;
    let client = client();

    // Broken YAML through SIGHUP: logged, counted, old config kept.
    std::fs::write(
        &gw.config,
        "listen: \"127.0.0.1:1\"\nreplicas:\n  - url: [unclosed\n",
    )
    .unwrap();
    gw.proc.signal("HUP");
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !gw
        .metrics()
        .await
        .contains("kvgate_config_reloads_total{result=\"failure\"} 1")
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the failed reload was not counted"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(gw.replicas().await.len(), 2);
    assert_eq!(
        send(
            &client,
            &gw.url(),
            "/v1/completions",
            &completion("still here", false)
        )
        .await
        .text,
        "still here"
    );

    // Through the admin API the errors come back, with path and line.
    let r = client
        .post(format!("{}/admin/reload", gw.admin()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let v: serde_json::Value = r.json().await.unwrap();
    let errors = v["errors"].as_array().unwrap();
    let first = errors[0].as_str().unwrap();
    assert!(
        first.starts_with("line 3: replicas[0].url: invalid type"),
        "{v}"
    );

    let bad_field = Gateway::yaml(
        gw.port,
        gw.admin_port,
        &[&a, &b],
        "retries:\n  attempts: 0\npolicy:\n  wieghts: {}\n",
    );
    std::fs::write(&gw.config, bad_field).unwrap();
    let v: serde_json::Value = client
        .post(format!("{}/admin/reload", gw.admin()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let message = v["errors"][0].as_str().unwrap();
    assert!(
        message.contains("policy") && message.contains("wieghts"),
        "{message}"
    );

    // A valid config again: accepted.
    std::fs::write(&gw.config, Gateway::yaml(gw.port, gw.admin_port, &[&a], "")).unwrap();
    let r = client
        .post(format!("{}/admin/reload", gw.admin()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(gw.replicas().await.len(), 1);
}

#[test]
fn check_config_reports_every_error_with_its_path() {
    let bad = temp_file_with(
        "check",
        ".yaml",
        "listen: \"nowhere\"\nreplicas:\n  - url: \"http://127.0.0.1:1\"\n    max_in_flight: 0\nretries:\n  attempts: 99\n",
    );
    let out = kvgate()
        .args(["check-config", bad.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    for path in ["listen:", "replicas[0].max_in_flight:", "retries.attempts:"] {
        assert!(stdout.contains(path), "missing {path} in:\n{stdout}");
    }
    let good = temp_file_with(
        "check-ok",
        ".yaml",
        "listen: \"127.0.0.1:8080\"\nreplicas:\n  - url: \"http://127.0.0.1:9001\"\n",
    );
    let out = kvgate()
        .args(["check-config", good.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    // A key under its old name still works, with a warning.
    std::fs::write(
        &good,
        "listen: \"127.0.0.1:8080\"\nreplicas:\n  - url: \"http://127.0.0.1:9001\"\npolicy:\n  speculative_ttl_ms: 100\n",
    )
    .unwrap();
    let out = kvgate()
        .args(["check-config", good.to_str().unwrap()])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(
        stdout.contains(
            "warning: policy.speculative_ttl_ms is deprecated: it is now policy.assumed_ttl_ms"
        ),
        "{stdout}"
    );
}

#[test]
fn every_file_in_config_is_valid() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "yaml") {
            let out = kvgate()
                .args(["check-config", path.to_str().unwrap()])
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{}:\n{}",
                path.display(),
                String::from_utf8_lossy(&out.stdout)
            );
            checked += 1;
        }
    }
    assert!(
        checked >= 2,
        "expected the example configs in {}",
        dir.display()
    );
}
