//! The end-to-end harness itself: a free port can be taken by another process between the
//! moment a test picks it and the moment its server listens (an ephemeral port of someone's
//! outgoing connection or listener); such a start is tried again, not waited on until it fails.

mod common;

use common::*;
use std::net::TcpListener;
use std::sync::Mutex;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_whose_port_was_taken_starts_again_on_another() {
    // The test takes the first port itself; where another process was quicker (the very race
    // the harness survives), the scenario did not happen as planned and is played again.
    for _ in 0..5 {
        let first: Mutex<Option<(u16, Option<TcpListener>)>> = Mutex::new(None);
        let (proc, port) = start_on_free_port("worker", |port| {
            let mut first = first.lock().unwrap();
            if first.is_none() {
                *first = Some((port, take(port).unwrap()));
            }
            let mut cmd = kvgate();
            cmd.args(["fault-worker", "--port", &port.to_string()]);
            cmd
        })
        .await;
        let (first_port, held) = first.into_inner().unwrap().unwrap();
        if held.is_none() {
            continue;
        }
        assert_ne!(port, first_port, "started on the port it could not take");
        wait_ok(&format!("http://127.0.0.1:{port}/health")).await;
        drop(proc);
        return;
    }
    panic!("five times in a row another process took the test's first port before the test");
}

/// Binds `port`, or `None` where another socket holds it already.
fn take(port: u16) -> std::io::Result<Option<TcpListener>> {
    match TcpListener::bind(("127.0.0.1", port)) {
        Ok(listener) => Ok(Some(listener)),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => Ok(None),
        Err(e) => Err(e),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[should_panic(expected = "exited (exit status: 2) before")]
async fn a_server_that_exits_for_another_reason_fails_the_test_with_its_log() {
    start_on_free_port("worker", |port| {
        let mut cmd = kvgate();
        cmd.args([
            "fault-worker",
            "--port",
            &port.to_string(),
            "--no-such-flag",
        ]);
        cmd
    })
    .await;
}
