//! SLA classes end to end: a saturated fleet (one sim worker, one request at a time) serves
//! queued interactive requests before queued batch ones, refuses a sheddable class with 429
//! and `Retry-After`, bounds each class's queue and deadline; pools keep each class on its
//! own replicas, chosen by the tenant's key or by a header where trusted or allowed.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use std::time::{Duration, Instant};

const CLASSES: &str = r#"
sla:
  default_class: interactive
  trust_class_header: true
  classes:
    interactive: {priority: 10}
    batch: {priority: 0, max_queue: 4}
    scavenger: {sheddable: true}
    impatient: {priority: 5, queue_timeout_ms: 200}
"#;

struct Reply {
    status: u16,
    retry_after: Option<String>,
    replica: Option<String>,
    finished: Instant,
}

async fn ask(url: &str, class: Option<&str>, key: Option<&str>, max_tokens: u32) -> Reply {
    let mut req = client()
        .post(format!("{url}/v1/completions"))
        .header("x-kvgate-debug", "1")
        .json(&serde_json::json!({
            "model": MODEL, "prompt": "tell me a story", "max_tokens": max_tokens, "ignore_eos": true,
        }));
    if let Some(c) = class {
        req = req.header("x-kvgate-class", c);
    }
    if let Some(k) = key {
        req = req.header("authorization", format!("Bearer {k}"));
    }
    let r = req.send().await.unwrap();
    let header = |name: &str| {
        r.headers()
            .get(name)
            .map(|v| v.to_str().unwrap().to_string())
    };
    let (status, retry_after, replica) = (
        r.status().as_u16(),
        header("retry-after"),
        header("x-kvgate-replica"),
    );
    let _ = r.bytes().await;
    Reply {
        status,
        retry_after,
        replica,
        finished: Instant::now(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interactive_goes_first_batch_waits_scavengers_are_shed() {
    let w = SimWorker::start(&["--time-scale", "2"]).await;
    let gw = Gateway::start(&[&w], CLASSES).await;
    // One request at a time on the only replica: the fleet saturates at once.
    let yaml = std::fs::read_to_string(&gw.config).unwrap().replace(
        &format!("    id: \"{}\"\n", Upstream::id(&w)),
        &format!("    id: \"{}\"\n    max_in_flight: 1\n", Upstream::id(&w)),
    );
    std::fs::write(&gw.config, yaml).unwrap();
    gw.proc.signal("HUP");
    tokio::time::sleep(Duration::from_millis(300)).await;

    let long = 120;
    let url = gw.url();
    let spawn_ask = |class: &'static str, delay_ms: u64| {
        let url = url.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(delay_ms)).await;
            ask(&url, Some(class), None, long).await
        })
    };
    let running = spawn_ask("batch", 0);
    let batch: Vec<_> = (0..4).map(|i| spawn_ask("batch", 100 + i * 10)).collect();
    let interactive: Vec<_> = (0..2)
        .map(|i| spawn_ask("interactive", 250 + i * 10))
        .collect();
    tokio::time::sleep(Duration::from_millis(350)).await;

    // Saturated: the sheddable class is refused at once, a fifth queued batch request finds
    // its queue full, and an impatient one gives up at its deadline.
    let shed = ask(&url, Some("scavenger"), None, 4).await;
    assert_eq!((shed.status, shed.retry_after.as_deref()), (429, Some("1")));
    let full = ask(&url, Some("batch"), None, 4).await;
    assert_eq!(full.status, 429, "batch queue full");
    let started = Instant::now();
    let impatient = ask(&url, Some("impatient"), None, 4).await;
    assert_eq!(impatient.status, 503);
    assert!(started.elapsed() >= Duration::from_millis(190));

    assert_eq!(running.await.unwrap().status, 200);
    let interactive: Vec<Reply> = futures_util::future::join_all(interactive)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let batch: Vec<Reply> = futures_util::future::join_all(batch)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert!(interactive.iter().chain(&batch).all(|r| r.status == 200));
    let last_interactive = interactive.iter().map(|r| r.finished).max().unwrap();
    let first_batch = batch.iter().map(|r| r.finished).min().unwrap();
    assert!(
        last_interactive < first_batch,
        "interactive requests that arrived later are served before the queued batch ones"
    );
    let m = gw.metrics().await;
    for (line, want) in [
        (
            "kvgate_admission_refused_total{class=\"scavenger\",reason=\"shed\"}",
            1.0,
        ),
        (
            "kvgate_admission_refused_total{class=\"batch\",reason=\"queue_full\"}",
            1.0,
        ),
        (
            "kvgate_admission_refused_total{class=\"impatient\",reason=\"deadline\"}",
            1.0,
        ),
        ("kvgate_admission_queue_depth{class=\"batch\"}", 0.0),
    ] {
        assert_eq!(metric(&m, line), want, "{line}\n{m}");
    }
    // Not saturated any more: the sheddable class is served.
    assert_eq!(ask(&url, Some("scavenger"), None, 4).await.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pools_keep_classes_on_their_replicas() {
    let (a, b) = (
        SimWorker::start(&["--time-scale", "0.01"]).await,
        SimWorker::start(&["--time-scale", "0.01"]).await,
    );
    let hash = |key: &str| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvgate"))
            .arg("hash-key")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .and_then(|mut c| {
                use std::io::Write;
                writeln!(c.stdin.take().unwrap(), "{key}")?;
                c.wait_with_output()
            })
            .unwrap();
        String::from_utf8(out.stdout).unwrap().trim().to_string()
    };
    let sla = format!(
        "sla:\n  default_class: interactive\n  classes:\n    interactive: {{pool: {{tier: online}}}}\n    batch: {{pool: {{tier: offline}}}}\n    orphan: {{pool: {{tier: nowhere}}}}\ntenants:\n  app: {{api_keys: [\"{}\"], allowed_classes: [batch, orphan]}}\n  jobs: {{api_keys: [\"{}\"], class: batch}}\n",
        hash("sk-app-key"),
        hash("sk-batch-key")
    );
    let mut gw = Gateway::start(&[&a, &b], &sla).await;
    let url = gw.url();
    let label = |w: &SimWorker, tier: &str| {
        (
            format!("    id: \"{}\"\n", Upstream::id(w)),
            format!(
                "    id: \"{}\"\n    labels: {{tier: {tier}}}\n",
                Upstream::id(w)
            ),
        )
    };
    let mut yaml = std::fs::read_to_string(&gw.config).unwrap();
    for (from, to) in [label(&a, "online"), label(&b, "offline")] {
        yaml = yaml.replace(&from, &to);
    }
    std::fs::write(&gw.config, yaml).unwrap();
    gw.proc.signal("HUP");
    tokio::time::sleep(Duration::from_millis(300)).await;
    for _ in 0..6 {
        let online = ask(&url, None, Some("sk-app-key"), 2).await;
        assert_eq!(
            online.replica,
            Some(Upstream::id(&a)),
            "the default class: online pool"
        );
        let offline = ask(&url, None, Some("sk-batch-key"), 2).await;
        assert_eq!(
            offline.replica,
            Some(Upstream::id(&b)),
            "the tenant's class: batch"
        );
        let header = ask(&url, Some("batch"), Some("sk-app-key"), 2).await;
        assert_eq!(
            header.replica,
            Some(Upstream::id(&b)),
            "an allowed class by header: batch"
        );
    }
    let key = Some("sk-app-key");
    assert_eq!(ask(&url, Some("orphan"), key, 2).await.status, 404);
    assert_eq!(ask(&url, Some("gold"), key, 2).await.status, 400);
    assert_eq!(
        ask(&url, Some("interactive"), Some("sk-batch-key"), 2)
            .await
            .status,
        403
    );
    gw.proc.kill();
}
