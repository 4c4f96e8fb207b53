//! `kvgate up`: one command brings up a gateway and workers under agents; requests flow; a
//! SIGTERM stops every process.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvgate_up_runs_a_fleet_under_agents_and_stops_it() {
    let (port, admin_port) = (free_port(), free_port());
    let first_worker = free_ports(2);
    let second_worker = first_worker + 1;
    let mut cmd = kvgate();
    cmd.args([
        "up",
        "--workers",
        "2",
        "--backend",
        "sim",
        "--port",
        &port.to_string(),
        "--admin-port",
        &admin_port.to_string(),
        "--first-worker-port",
        &first_worker.to_string(),
        "--served-model-name",
        MODEL,
    ]);
    let up = spawn(cmd, &format!("up-{port}"));
    let admin = format!("http://127.0.0.1:{admin_port}");
    wait_ok(&format!("{admin}/health")).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let v = get_json(&format!("{admin}/admin/replicas")).await;
        let ready = v["replicas"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["available"] == true && r["freshness"] == "fresh")
            .count();
        if ready == 2 {
            break;
        }
        assert!(Instant::now() < deadline, "fleet not up: {v:#}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let gateway = format!("http://127.0.0.1:{port}");
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

    up.signal("TERM");
    let deadline = Instant::now() + Duration::from_secs(20);
    for p in [port, admin_port, first_worker, second_worker] {
        while std::net::TcpStream::connect(("127.0.0.1", p)).is_ok() {
            assert!(
                Instant::now() < deadline,
                "port {p} still open after SIGTERM"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}
