//! Logging never stalls serving: a gateway whose stderr nobody reads (a full pipe, a stuck
//! log shipper, a slow disk) drops log lines and goes on proxying.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use std::process::Stdio;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_whose_stderr_is_never_read_goes_on_serving() {
    let worker = Worker::start(&[]).await;
    let (port, admin_port) = (free_port(), free_port());
    let config = temp_file_with(
        &format!("logging-{port}"),
        ".yaml",
        Gateway::yaml(port, admin_port, &[&worker], ""),
    );
    // Debug logging writes about 2 KB a request: the 64 KB pipe is full after some 30.
    let mut cmd = kvgate();
    cmd.args(["gateway", "--config", config.to_str().unwrap()])
        .env("KVGATE_LOG", "debug")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut gateway = Proc {
        child: cmd.spawn().unwrap(),
        name: "gateway with an unread stderr".into(),
        log: temp_file("unread-stderr", ".log").into_temp_path(),
    };
    let _unread = gateway.child.stderr.take();
    let url = format!("http://127.0.0.1:{port}");
    wait_ok(&format!("{url}/health")).await;
    let client = client();
    for i in 0..200 {
        let sent = client
            .post(format!("{url}/v1/completions"))
            .json(&serde_json::json!({ "model": MODEL, "prompt": format!("hello {i}"), "max_tokens": 4 }))
            .timeout(Duration::from_secs(10))
            .send()
            .await;
        let status = sent.map(|r| r.status().as_u16());
        assert!(
            matches!(status, Ok(200)),
            "request {i} through a gateway with an unread stderr: {status:?}"
        );
    }
}
