//! What the gateway sends a replica, byte by byte: read by a replica played by the test, which
//! records every request it is sent and answers as an OpenAI server would.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A replica serving model `m` that keeps each generation request as it arrived.
struct RecordingReplica {
    port: u16,
    requests: Arc<Mutex<Vec<Vec<u8>>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for RecordingReplica {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Upstream for RecordingReplica {
    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
    fn id(&self) -> String {
        format!("recording{}", self.port)
    }
}

impl RecordingReplica {
    async fn start() -> RecordingReplica {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let requests = Arc::new(Mutex::new(Vec::new()));
        let kept = requests.clone();
        let task = tokio::spawn(async move {
            while let Ok((s, _)) = listener.accept().await {
                tokio::spawn(serve(s, kept.clone()));
            }
        });
        RecordingReplica {
            port,
            requests,
            task,
        }
    }
}

/// Answers each request on the connection in turn, keeping it alive.
async fn serve(mut s: TcpStream, requests: Arc<Mutex<Vec<Vec<u8>>>>) {
    let mut buf = Vec::new();
    loop {
        let Some(end) = read_until_head_end(&mut s, &mut buf).await else {
            return;
        };
        let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
        let length: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length: "))
            .map_or(0, |v| v.trim().parse().unwrap());
        while buf.len() < end + length {
            let mut chunk = [0u8; 4096];
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        let request: Vec<u8> = buf.drain(..end + length).collect();
        let body = if head.starts_with("get /v1/models") {
            r#"{"object":"list","data":[{"id":"m","object":"model"}]}"#.to_string()
        } else if head.starts_with("post ") {
            requests.lock().unwrap().push(request);
            r#"{"id":"x","object":"chat.completion","created":0,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#.to_string()
        } else {
            "ok".to_string()
        };
        let answer = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        if s.write_all(answer.as_bytes()).await.is_err() {
            return;
        }
    }
}

/// Reads until `buf` holds a whole request head; the offset just past it.
async fn read_until_head_end(s: &mut TcpStream, buf: &mut Vec<u8>) -> Option<usize> {
    loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            return Some(i + 4);
        }
        let mut chunk = [0u8; 4096];
        match s.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_gets_the_clients_headers_less_the_connections_and_the_body_whole() {
    let replica = RecordingReplica::start().await;
    let gw = Gateway::start(&[&replica], "").await;
    let body = serde_json::json!({
        "model": "m",
        "messages": [{"role": "user", "content": "héllo, \"wire\"\r\n"}],
        "max_tokens": 2,
    });
    let resp = client()
        .post(format!("{}/v1/chat/completions", gw.url()))
        .header("x-custom", "kept as sent")
        .header("te", "trailers")
        .header("keep-alive", "timeout=5")
        .header("x-request-id", "client-id-7")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-request-id"], "client-id-7");
    let answer: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(answer["choices"][0]["message"]["content"], "hi");

    let requests = replica.requests.lock().unwrap().clone();
    assert_eq!(requests.len(), 1);
    let raw = &requests[0];
    let end = raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
    let head = std::str::from_utf8(&raw[..end]).unwrap();
    let lines: Vec<&str> = head.trim_end().split("\r\n").collect();
    assert_eq!(lines[0], "POST /v1/chat/completions HTTP/1.1", "{head}");
    let values = |name: &str| -> Vec<&str> {
        lines[1..]
            .iter()
            .filter_map(|l| l.split_once(": "))
            .filter(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v)
            .collect()
    };
    assert_eq!(values("x-custom"), ["kept as sent"], "{head}");
    assert_eq!(values("content-type"), ["application/json"], "{head}");
    assert_eq!(
        values("host"),
        [format!("127.0.0.1:{}", replica.port)],
        "{head}"
    );
    assert_eq!(values("x-request-id"), ["client-id-7"], "{head}");
    for hop in ["te", "keep-alive", "connection", "transfer-encoding"] {
        assert!(values(hop).is_empty(), "{hop} forwarded: {head}");
    }
    let sent = &raw[end..];
    assert_eq!(values("content-length"), [sent.len().to_string()], "{head}");
    let sent: serde_json::Value = serde_json::from_slice(sent).unwrap();
    assert_eq!(sent["messages"], body["messages"]);
}
