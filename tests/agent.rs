//! `kvgate agent` with real processes on loopback: it supervises a sim worker, reports to the
//! gateway (which lets it join the fleet), restarts the worker when it dies — the gateway
//! excludes the replica meanwhile, drops the blocks the old worker's KV events placed in its
//! precise index, and takes it back with its new instance — and stops it
//! gracefully on SIGTERM, after which the gateway marks it stale, then excluded. Reports
//! without the right token get 401.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use std::time::{Duration, Instant};

const TOKEN: &str = "agent-test-token";

fn token_file(port: u16) -> tempfile::TempPath {
    temp_file_with(&format!("token-{port}"), "", format!("{TOKEN}\n"))
}

fn agents_yaml(token: &std::path::Path, join: &str) -> String {
    format!(
        "agents:\n  token_file: \"{}\"\n  stale_after_ms: 400\n  exclude_after_ms: 1500\n  join: {join}\n",
        token.display()
    )
}

/// Token mode for [`MODEL`] with the default GGUF; guesses expire after 100 ms.
fn token_mode_yaml() -> String {
    let model = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    format!(
        "tokenizers:\n  - model: {MODEL}\n    path: \"{}\"\npolicy:\n  assumed_ttl_ms: 100\n",
        model.display()
    )
}

async fn explain_chat(gw: &Gateway, text: &str) -> serde_json::Value {
    gw.explain(&chat(text, false)).await
}

/// Polls the explain API until the top candidate's prefix signal for a chat satisfies `check`.
async fn wait_prefix(gw: &Gateway, text: &str, what: &str, check: impl Fn(f64) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let e = explain_chat(gw, text).await;
        let prefix = e["candidates"][0]["score"]["signals"]["prefix"].as_f64();
        if prefix.is_some_and(&check) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}: {e:#}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn wait_for(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A chat request through the gateway must succeed.
async fn chat_ok(gw: &Gateway, text: &str) {
    let answer = send(
        &client(),
        &gw.url(),
        "/v1/chat/completions",
        &chat(text, false),
    )
    .await;
    assert_eq!(answer.status, 200, "{answer:?}");
}

/// Sends a completion and waits until the gateway has let it go, as a client that reads the
/// answer before its next request would (a request still counted in flight can tip its replica
/// over the load bound, where stickiness yields).
async fn settled(gw: &Gateway, body: &serde_json::Value) -> Answer {
    let a = send(&client(), &gw.url(), "/v1/completions", body).await;
    gw.wait_until(|rs| rs.iter().all(|r| r["in_flight"] == 0))
        .await;
    a
}

async fn replica(gw: &Gateway, id: &str) -> Option<serde_json::Value> {
    gw.replicas().await.into_iter().find(|r| r["id"] == id)
}

/// Polls the gateway until replica `id` satisfies `check`.
async fn wait_replica(
    gw: &Gateway,
    id: &str,
    what: &str,
    check: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        if let Some(r) = replica(gw, id).await {
            if check(&r) {
                return r;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}: {r:#}"
            );
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}: no replica {id}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_supervises_its_worker_and_the_gateway_follows() {
    let admin_port = free_port();
    let token = token_file(admin_port);
    // No static replicas: the worker joins by reporting.
    let (port, worker_port) = (free_port(), free_port());
    let config = temp_file_with(
        &format!("agent-{port}"),
        ".yaml",
        format!(
            "listen: \"127.0.0.1:{port}\"\nadmin_listen: \"127.0.0.1:{admin_port}\"\nreplicas: []\n{}{}",
            agents_yaml(&token, "open"),
            token_mode_yaml()
        ),
    );
    let mut cmd = kvgate();
    cmd.args(["gateway", "--config", config.to_str().unwrap()]);
    let mut gw = Gateway {
        proc: spawn(cmd, &format!("gateway-{port}")),
        port,
        admin_port,
        config,
    };
    gw.wait_ready().await.expect("port taken");

    let worker_url = format!("http://127.0.0.1:{worker_port}");
    // A second gateway, down: the agent still reports to the first, and says there are two.
    let gateway_down = format!("http://127.0.0.1:{}", free_port());
    let mut cmd = kvgate();
    cmd.args([
        "agent",
        "--gateway",
        &gw.admin(),
        "--gateway",
        &gateway_down,
        "--token-file",
        token.to_str().unwrap(),
        "--url",
        &worker_url,
        "--replica-id",
        "w0",
        "--interval-ms",
        "50",
        // A long first restart delay, so that the window in which the gateway must exclude the
        // dead worker is wide enough to observe on a loaded machine.
        "--restart-backoff-ms",
        "2000",
        "--",
        env!("CARGO_BIN_EXE_kvgate"),
        "worker",
        "--backend",
        "sim",
        "--port",
        &worker_port.to_string(),
        "--served-model-name",
        MODEL,
        "--time-scale",
        "0.01",
    ]);
    let agent = spawn(cmd, &format!("agent-{worker_port}"));
    let first = wait_replica(&gw, "w0", "w0 to join and be fresh", |r| {
        r["freshness"] == "fresh" && r["available"] == true
    })
    .await;
    let instance = first["agent"]["instance"].as_u64().unwrap();
    assert_eq!(first["models"], serde_json::json!([MODEL]), "{first:#}");
    assert_eq!(first["agent"]["gateways"], 2, "{first:#}");
    chat_ok(&gw, "hello agent").await;
    // Token mode: the worker's KV events put the prompt's blocks on w0 (guesses expire in
    // 100 ms, so this is the events' doing).
    wait_prefix(&gw, "hello agent", "the events to place the blocks", |p| {
        p > 0.5
    })
    .await;

    // Kill the worker: the gateway stops routing to it, the agent starts a new one.
    let worker_pid = children(agent.child.id());
    assert_eq!(
        worker_pid.len(),
        1,
        "one worker under the agent: {worker_pid:?}"
    );
    std::process::Command::new("kill")
        .args(["-KILL", &worker_pid[0].to_string()])
        .status()
        .unwrap();
    wait_replica(&gw, "w0", "w0 excluded while its worker is down", |r| {
        r["available"] == false
    })
    .await;
    let back = wait_replica(&gw, "w0", "w0 back with a new instance", |r| {
        r["available"] == true && r["agent"]["instance"].as_u64() != Some(instance)
    })
    .await;
    let new_pid = children(agent.child.id());
    assert_eq!(new_pid.len(), 1);
    assert_ne!(new_pid[0], worker_pid[0], "a new worker process");
    assert!(back["agent"]["healthy"] == true, "{back:#}");
    let e = explain_chat(&gw, "hello agent").await;
    assert_eq!(
        e["candidates"][0]["score"]["signals"]["prefix"], 0.0,
        "the restarted worker's blocks were dropped: {e:#}"
    );
    chat_ok(&gw, "hello again").await;
    wait_prefix(&gw, "hello again", "the new worker's events", |p| p > 0.5).await;

    // SIGTERM: the agent stops its worker gracefully and stops reporting.
    agent.signal("TERM");
    wait_for("the worker to stop", || {
        std::net::TcpStream::connect(("127.0.0.1", worker_port)).is_err()
    })
    .await;
    // Stale (scored down) first, then excluded; a slow poll may only see the second.
    wait_replica(&gw, "w0", "w0 stale", |r| {
        r["freshness"] == "stale" || r["freshness"] == "excluded"
    })
    .await;
    wait_replica(&gw, "w0", "w0 excluded", |r| {
        r["freshness"] == "excluded" && r["available"] == false
    })
    .await;
}

async fn report(
    admin: &str,
    auth: Option<&str>,
    body: &serde_json::Value,
) -> (u16, serde_json::Value) {
    let mut req = client().post(format!("{admin}/agent/report")).json(body);
    if let Some(a) = auth {
        req = req.header("authorization", a);
    }
    let r = req.send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or_default())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reports_need_the_token_and_a_known_replica() {
    let w = SimWorker::start(&["--time-scale", "0.01"]).await;
    let token = token_file(w.port);
    let gw = Gateway::start(&[&w], &agents_yaml(&token, "static")).await;
    let good = serde_json::json!({
        "version": 2, "replica": w.id(), "url": w.url(), "instance": 7, "seq": 1, "healthy": true,
        "load": {"models": [MODEL], "running": 0, "waiting": 3, "kv_blocks_total": 100,
                 "kv_blocks_used": 10, "block_size": 16},
    });
    let bearer = format!("Bearer {TOKEN}");
    for auth in [None, Some("Bearer wrong-token"), Some(TOKEN)] {
        let (s, e) = report(&gw.admin(), auth, &good).await;
        assert_eq!(s, 401, "{auth:?}: {e}");
    }
    assert!(
        replica(&gw, &w.id()).await.unwrap()["agent"].is_null(),
        "rejected reports are ignored"
    );

    let (s, e) = report(&gw.admin(), Some(&bearer), &good).await;
    assert_eq!(s, 200, "{e}");
    assert_eq!(
        e["kv_snapshot"], false,
        "no KV events, nothing to resynchronise"
    );
    let r = replica(&gw, &w.id()).await.unwrap();
    assert_eq!(r["agent"]["waiting"], 3, "{r:#}");
    assert_eq!(r["freshness"], "fresh");

    let mut unknown = good.clone();
    unknown["replica"] = "elsewhere".into();
    unknown["url"] = "http://127.0.0.1:1".into();
    let (s, e) = report(&gw.admin(), Some(&bearer), &unknown).await;
    assert_eq!(s, 404, "static fleets do not take new replicas: {e}");
    // Another agent reporting under this replica's name, for another server, is refused: its
    // reports would look like restarts and void the replica's cache state each time.
    let mut impostor = good.clone();
    impostor["url"] = "http://127.0.0.1:1".into();
    impostor["instance"] = 8.into();
    let (s, e) = report(&gw.admin(), Some(&bearer), &impostor).await;
    assert_eq!(s, 403, "{e}");
    assert_eq!(
        replica(&gw, &w.id()).await.unwrap()["agent"]["instance"],
        7,
        "the replica keeps its own agent's state"
    );
    let mut future = good.clone();
    future["version"] = 3.into();
    assert_eq!(report(&gw.admin(), Some(&bearer), &future).await.0, 400);
    let mut extra = good.clone();
    extra["surprise"] = true.into();
    assert_eq!(report(&gw.admin(), Some(&bearer), &extra).await.0, 400);

    // An agent says how many gateways it reports to; the gateway counts the most any says.
    for n in [0, 1_025] {
        let mut bad = good.clone();
        bad["gateways"] = n.into();
        let (s, e) = report(&gw.admin(), Some(&bearer), &bad).await;
        assert_eq!(s, 400, "{n} gateways: {e}");
        assert!(e.to_string().contains("gateways"), "{e}");
    }
    let mut eight = good.clone();
    eight["gateways"] = 8.into();
    assert_eq!(report(&gw.admin(), Some(&bearer), &eight).await.0, 200);
    assert_eq!(replica(&gw, &w.id()).await.unwrap()["agent"]["gateways"], 8);
    let explained = explain_chat(&gw, "hello").await;
    assert_eq!(
        (
            explained["gateways"].clone(),
            explained["gateways_seen"].clone()
        ),
        (8.into(), 1.into()),
        "{explained:#}"
    );
    assert_eq!(report(&gw.admin(), Some(&bearer), &good).await.0, 200);
    assert_eq!(explain_chat(&gw, "hello").await["gateways"], 1);

    // KV events: without a snapshot, or after a gap, the gateway asks for a snapshot.
    let mut with_kv = good.clone();
    let batch = |seq: u64| {
        serde_json::json!({"version": 1, "seq": seq, "events": [
        {"type": "stored", "hashes": [seq], "parent": null, "tier": "device"}]})
    };
    with_kv["kv"] = serde_json::json!({"batches": [batch(4)]});
    let (s, e) = report(&gw.admin(), Some(&bearer), &with_kv).await;
    assert_eq!(
        (s, e["kv_snapshot"].clone()),
        (200, true.into()),
        "no snapshot yet: {e}"
    );
    with_kv["kv"] = serde_json::json!({
        "snapshot": {"version": 1, "seq": 4, "block_size": 16, "hashes": [1, 2]},
        "batches": [batch(5)],
    });
    let (s, e) = report(&gw.admin(), Some(&bearer), &with_kv).await;
    assert_eq!((s, e["kv_snapshot"].clone()), (200, false.into()), "{e}");
    with_kv["kv"] = serde_json::json!({"batches": [batch(7)]});
    let (s, e) = report(&gw.admin(), Some(&bearer), &with_kv).await;
    assert_eq!(
        (s, e["kv_snapshot"].clone()),
        (200, true.into()),
        "batch 6 is missing: {e}"
    );
    assert!(gw
        .metrics()
        .await
        .contains("kvgate_kv_event_batches_total{result=\"resync\"} 2"));

    // A gap in sequence numbers is counted; an unhealthy report excludes at once.
    let mut later = good.clone();
    later["seq"] = 5.into();
    later["healthy"] = false.into();
    assert_eq!(report(&gw.admin(), Some(&bearer), &later).await.0, 200);
    let r = replica(&gw, &w.id()).await.unwrap();
    assert_eq!(
        (r["agent"]["missed_reports"].clone(), r["available"].clone()),
        (3.into(), false.into()),
        "{r:#}"
    );
    assert!(gw
        .metrics()
        .await
        .contains("kvgate_agent_reports_total{result=\"unauthorized\"} 3"));
}

/// Reported KV pressure saturates a replica: its prefix loses its stickiness, yet the prompt
/// it holds still goes there while no other replica would serve it sooner. A long queue is a
/// hard limit: its shared-prefix requests spill to another replica, and once it recovers it
/// is a holder like the other again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_pressure_suspends_stickiness_and_a_long_queue_spills_a_prefix_until_recovery() {
    let (a, b) = (Worker::start(&[]).await, Worker::start(&[]).await);
    let token = token_file(a.port);
    // Long thresholds: these hand-made reports must stay fresh for the whole test. The limits
    // at 90 % of KV and 16 queued (the defaults, 100 % and 256, are past these reports).
    let yaml = format!(
        "agents:\n  token_file: \"{}\"\n  stale_after_ms: 60000\n  exclude_after_ms: 120000\npolicy:\n  kv_saturation: 0.9\n  queue_saturation: 16\n",
        token.display()
    );
    let gw = Gateway::start(&[&a, &b], &yaml).await;
    let bearer = format!("Bearer {TOKEN}");
    let mut seq = 0;
    let mut report_for = |w: &Worker, used: u64, waiting: u32| {
        seq += 1;
        serde_json::json!({
            "version": 2, "replica": w.id(), "url": w.url(), "instance": 1, "seq": seq,
            "healthy": true,
            "load": {"models": [MODEL], "running": 0, "waiting": waiting, "kv_blocks_total": 100,
                     "kv_blocks_used": used, "block_size": 16},
        })
    };
    for w in [&a, &b] {
        let r = report_for(w, 10, 0);
        assert_eq!(report(&gw.admin(), Some(&bearer), &r).await.0, 200);
    }
    let shared = "a long shared system prompt that spans several routing chunks ".repeat(20);
    let ask = |i: usize| completion(&format!("{shared} question {i}"), false);
    // A request of another prompt first: a group that is all the traffic is hot, and spreads.
    let other = "another system prompt, of another group of requests ".repeat(20);
    settled(&gw, &completion(&other, false)).await;
    let home = settled(&gw, &ask(0)).await.replica.unwrap();
    assert_eq!(settled(&gw, &ask(1)).await.replica.unwrap(), home);
    let (home_w, other_w) = if home == a.id() { (&a, &b) } else { (&b, &a) };

    let r = report_for(home_w, 95, 0);
    assert_eq!(report(&gw.admin(), Some(&bearer), &r).await.0, 200);
    let explained = gw.explain(&ask(2)).await;
    let top = &explained["candidates"][0];
    assert_eq!(top["replica"], home.as_str(), "KV 95 % used: {explained:#}");
    assert_eq!(top["score"]["saturated"], true, "{explained:#}");
    assert_eq!(top["score"]["signals"]["prefix"], 0.0, "{explained:#}");
    assert_eq!(settled(&gw, &ask(2)).await.replica.unwrap(), home);

    let r = report_for(home_w, 10, 20);
    assert_eq!(report(&gw.admin(), Some(&bearer), &r).await.0, 200);
    let spilled = settled(&gw, &ask(3)).await.replica.unwrap();
    assert_eq!(spilled, other_w.id(), "20 queued: the prefix spills");
    let r = report_for(home_w, 10, 0);
    assert_eq!(report(&gw.admin(), Some(&bearer), &r).await.0, 200);
    // Recovered: the home is below its limits again and holds the prompt as the other now
    // does (the spill copied it there), a tie that a routed request draws from.
    let explained = gw.explain(&ask(4)).await;
    let candidates = explained["candidates"].as_array().unwrap();
    let at_home = candidates.iter().find(|c| c["replica"] == home.as_str());
    assert_eq!(
        at_home.unwrap()["score"]["saturated"],
        false,
        "recovered: {explained:#}"
    );
    assert_eq!(explained["tied"], 2, "both hold the prompt: {explained:#}");
}

/// A request naming a LoRA adapter goes where it is resident; one naming an adapter resident
/// nowhere goes to a replica with a free slot (sim workers that hold adapter names, reporting
/// through attached agents).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_naming_an_adapter_go_where_it_is_loaded() {
    let fast = ["--time-scale", "0.01"];
    let w1 = SimWorker::start(&[&fast[..], &["--lora-adapters", "sql-lora"]].concat()).await;
    let w2 = SimWorker::start(
        &[
            &fast[..],
            &[
                "--lora-adapters",
                "chat-lora",
                "--lora-catalog",
                "new-lora",
                "--max-loras",
                "2",
            ],
        ]
        .concat(),
    )
    .await;
    let w3 = SimWorker::start(&fast).await;
    let token = token_file(w1.port);
    let gw = Gateway::start(&[&w1, &w2, &w3], &agents_yaml(&token, "static")).await;
    let _agents: Vec<Proc> = [&w1, &w2, &w3]
        .iter()
        .map(|w| attach_agent(&gw, &token, *w, &["--interval-ms", "50"]))
        .collect();
    gw.wait_until(|rs| rs.iter().all(|r| r["freshness"] == "fresh"))
        .await;

    let ask = |model: &str, i: usize| {
        let mut body = completion(&format!("question {i} for {model}"), false);
        body["model"] = model.into();
        body
    };
    for (model, home) in [("sql-lora", w1.id()), ("chat-lora", w2.id())] {
        for i in 0..5 {
            let a = settled(&gw, &ask(model, i)).await;
            assert_eq!(
                (a.status, a.replica.as_deref()),
                (200, Some(home.as_str())),
                "{model} {i}"
            );
        }
    }
    // Resident nowhere: the replica with a free slot loads it.
    let a = settled(&gw, &ask("new-lora", 0)).await;
    assert_eq!(
        (a.status, a.replica.as_deref()),
        (200, Some(w2.id().as_str()))
    );
    let stats = w2.get("/stats").await;
    assert!(
        stats["adapters"]
            .as_array()
            .unwrap()
            .contains(&"new-lora".into()),
        "{stats}"
    );
    // An adapter nobody can load is not found.
    let a = settled(&gw, &ask("nope-lora", 0)).await;
    assert_eq!(a.status, 404, "{a:?}");
}
