//! `kvgate up`: one command brings up a gateway and workers under agents; requests flow; its
//! tokens are private; it admits only its own workers; a taken port fails at once; and
//! whenever it is stopped — SIGTERM after start-up or during it, even SIGKILL — no process of
//! the fleet is left.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::time::{Duration, Instant};

struct Up {
    proc: Proc,
    port: u16,
    admin_port: u16,
    first_worker: u16,
}

fn start_up(workers: u16) -> Up {
    start_up_with(workers, &[])
}

fn start_up_with(workers: u16, extra: &[&str]) -> Up {
    let (port, admin_port) = (free_port(), free_port());
    let first_worker = free_ports(workers);
    let mut cmd = kvgate();
    cmd.args(["up", "--workers", &workers.to_string(), "--backend", "sim"])
        .args(["--port", &port.to_string()])
        .args(["--admin-port", &admin_port.to_string()])
        .args(["--first-worker-port", &first_worker.to_string()])
        .args(["--served-model-name", MODEL])
        .args(extra);
    Up {
        proc: spawn(cmd, &format!("up-{port}")),
        port,
        admin_port,
        first_worker,
    }
}

/// The private directory `kvgate up` keeps its tokens in.
fn private_dir(port: u16) -> Option<PathBuf> {
    std::fs::read_dir(std::env::temp_dir())
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&format!("kvgate-up-{port}-")))
        })
}

/// The live processes started, directly or not, by `root`: every kvgate process names its
/// parent in `KVGATE_PARENT_PID`.
fn lineage(root: u32) -> Vec<u32> {
    let parent_of: Vec<(u32, u32)> = std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| {
            let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            // Zombies are dead already; they wait only for their parent to reap them.
            if stat.rsplit(')').next()?.trim_start().starts_with('Z') {
                return None;
            }
            let parent = env
                .split(|&b| b == 0)
                .find_map(|kv| kv.strip_prefix(b"KVGATE_PARENT_PID="))?;
            Some((pid, std::str::from_utf8(parent).ok()?.parse().ok()?))
        })
        .collect();
    let mut found = vec![root];
    let mut i = 0;
    while i < found.len() {
        let p = found[i];
        found.extend(parent_of.iter().filter(|(_, pp)| *pp == p).map(|(c, _)| *c));
        i += 1;
    }
    found.remove(0);
    found
}

/// Waits until nothing `root` started is alive (20 s at most).
async fn assert_nothing_left(root: u32, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let left = lineage(root);
        if left.is_empty() {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: still running: {left:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `kvgate up` with `workers` workers, once its gateway lists them all available and fresh;
/// started again on other ports where one was taken before its process could listen.
async fn ready_up(workers: u16, extra: &[&str]) -> Up {
    on_free_ports("kvgate up", async || {
        let mut up = start_up_with(workers, extra);
        let ready = wait_ready(&mut up, workers.into()).await;
        if ready.is_err() {
            up.proc.signal("TERM");
            up.proc.exits();
        }
        ready.map(|()| up)
    })
    .await
}

/// Waits until the gateway lists `n` workers, available and fresh (30 s at most), or `kvgate
/// up`'s log shows a port of its fleet taken by another process first.
async fn wait_ready(up: &mut Up, n: usize) -> Result<(), PortTaken> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut seen = serde_json::Value::Null;
    loop {
        let log = std::fs::read_to_string(&up.proc.log).unwrap_or_default();
        if log.contains("Address already in use") {
            return Err(PortTaken);
        }
        assert!(
            up.proc.child.try_wait().unwrap().is_none(),
            "kvgate up exited:\n{log}"
        );
        if let Some(v) = listed(up).await {
            let ready = v["replicas"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|r| r["available"] == true && r["freshness"] == "fresh")
                .count();
            if ready == n {
                return Ok(());
            }
            seen = v;
        }
        assert!(Instant::now() < deadline, "fleet not up: {seen:#}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The gateway's `/admin/replicas`, once `kvgate up` has written its admin token and the
/// admin listener answers.
async fn listed(up: &Up) -> Option<serde_json::Value> {
    let token = std::fs::read_to_string(private_dir(up.port)?.join("admin-token")).ok()?;
    client()
        .get(format!("http://127.0.0.1:{}/admin/replicas", up.admin_port))
        .bearer_auth(token.trim())
        .send()
        .await
        .ok()?
        .json()
        .await
        .ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvgate_up_runs_a_fleet_under_agents_and_stops_it() {
    let mut up = ready_up(2, &[]).await;
    let admin = format!("http://127.0.0.1:{}", up.admin_port);
    let dir = private_dir(up.port).expect("the private directory");
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&dir), 0o700);
    for file in ["agent-token", "admin-token", "gateway.yaml"] {
        assert_eq!(mode(&dir.join(file)), 0o600, "{file}");
    }
    let token = std::fs::read_to_string(dir.join("admin-token")).unwrap();
    assert!(token.trim().len() >= 64, "a random token");
    let replicas = |auth: Option<String>| {
        let mut r = client().get(format!("{admin}/admin/replicas"));
        if let Some(a) = auth {
            r = r.bearer_auth(a);
        }
        r.send()
    };
    assert_eq!(replicas(None).await.unwrap().status(), 401);
    let gateway = format!("http://127.0.0.1:{}", up.port);
    for i in 0..4 {
        let a = send(
            &client(),
            &gateway,
            "/v1/chat/completions",
            &chat(&format!("hi {i}"), false),
        )
        .await;
        assert_eq!(a.status, 200, "{a:?}");
    }

    // A rogue replica with the fleet's agent token is not admitted: the fleet joins only its
    // own workers, by name.
    let rogue = Worker::start(&[]).await;
    let report = serde_json::json!({ "version": 2, "replica": "rogue", "url": rogue.url(), "seq": 1, "instance": 1, "healthy": true,
        "load": { "models": [MODEL], "running": 0, "waiting": 0, "kv_blocks_total": 100, "kv_blocks_used": 0, "block_size": 16 } });
    let agent_token = std::fs::read_to_string(dir.join("agent-token")).unwrap();
    let r = client()
        .post(format!("{admin}/agent/report"))
        .bearer_auth(agent_token.trim())
        .json(&report)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404, "a rogue replica joined");
    let v: serde_json::Value = r.json().await.unwrap();
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("not in the fleet"),
        "{v}"
    );

    let pid = up.proc.child.id();
    up.proc.signal("TERM");
    assert_nothing_left(pid, "after SIGTERM").await;
    let deadline = Instant::now() + Duration::from_secs(20);
    for p in [up.port, up.admin_port, up.first_worker, up.first_worker + 1] {
        while std::net::TcpStream::connect(("127.0.0.1", p)).is_ok() {
            assert!(
                Instant::now() < deadline,
                "port {p} still open after SIGTERM"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    // Its children gone, `up` itself may still be cleaning up.
    assert!(up.proc.exits().success());
    assert!(
        private_dir(up.port).is_none(),
        "the private directory is removed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signal_during_start_up_leaves_nothing_behind() {
    let mut up = start_up(2);
    let pid = up.proc.child.id();
    // As soon as it has started something.
    let deadline = Instant::now() + Duration::from_secs(20);
    while lineage(pid).is_empty() {
        assert!(Instant::now() < deadline, "kvgate up started nothing");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    up.proc.signal("TERM");
    let status = up.proc.child.wait().unwrap();
    assert!(status.success(), "{status}");
    assert_nothing_left(pid, "after SIGTERM during start-up").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_up_takes_its_fleet_with_it() {
    let up = start_up(1);
    wait_ok(&format!("http://127.0.0.1:{}/health", up.admin_port)).await;
    let pid = up.proc.child.id();
    // The agent has started its worker.
    let deadline = Instant::now() + Duration::from_secs(20);
    while lineage(pid).len() < 3 {
        assert!(
            Instant::now() < deadline,
            "fleet incomplete: {:?}",
            lineage(pid)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    up.proc.signal("KILL");
    assert_nothing_left(pid, "after SIGKILL of kvgate up").await;
    // A killed process cannot remove its private directory; the test does.
    if let Some(dir) = private_dir(up.port) {
        std::fs::remove_dir_all(dir).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_taken_port_fails_at_once_with_its_name() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let out = kvgate()
        .args(["up", "--workers", "1", "--backend", "sim"])
        .args(["--port", &free_port().to_string()])
        .args(["--admin-port", &free_port().to_string()])
        .args(["--first-worker-port", &port.to_string()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("port {port} for worker 0")),
        "{stderr}"
    );

    // The gateway alone does the same for its admin port.
    let config = temp_file_with(
        &format!("taken-{port}"),
        ".yaml",
        format!("listen: \"127.0.0.1:{}\"\nadmin_listen: \"127.0.0.1:{port}\"\nreplicas:\n  - url: \"http://127.0.0.1:9\"\n", free_port()),
    );
    let out = kvgate()
        .args(["gateway", "--config", config.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("admin_listen") && stderr.contains(&port.to_string()),
        "{stderr}"
    );
}

/// `--prefill-workers`: the first worker prefills, the second decodes, and a prompt reaches
/// the decode worker's cache from the prefill worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disaggregated_fleet_hands_prompts_to_its_decode_workers() {
    let mut up = ready_up(2, &["--prefill-workers", "1"]).await;
    let gateway = format!("http://127.0.0.1:{}", up.port);
    let body = serde_json::json!({"model": MODEL, "prompt": prompt_ids(1, 150), "max_tokens": 4});
    let (status, answer) = post(&gateway, "/v1/completions", &body).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(
        cached_tokens(&answer),
        144,
        "the prompt came from the prefill worker"
    );
    let pid = up.proc.child.id();
    up.proc.signal("TERM");
    assert_nothing_left(pid, "after SIGTERM").await;
    assert!(up.proc.exits().success());
}

#[test]
fn a_fleet_of_prefill_workers_alone_is_refused() {
    let out = kvgate()
        .args([
            "up",
            "--workers",
            "2",
            "--prefill-workers",
            "2",
            "--backend",
            "sim",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(
        text.contains("leaves none of the 2 workers to decode"),
        "{text}"
    );
}
