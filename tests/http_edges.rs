//! The gateway at HTTP's edges, spoken byte by byte over TCP: pipelined requests, HTTP/1.0
//! clients, too many headers, slow headers and bodies (slowloris), more connections than the
//! bound, a client that leaves
//! before its answer's first byte, and ones that stop reading it (HTTP/1.1 and h2c).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

fn connect(gw: &Gateway) -> TcpStream {
    let s = TcpStream::connect(("127.0.0.1", gw.port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s
}

/// Of `conns`, what each one the gateway has closed got first (the others are dropped).
fn closed(conns: Vec<TcpStream>) -> Vec<String> {
    let mut out = Vec::new();
    for mut s in conns {
        s.set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        let mut got = [0u8; 64];
        if let Ok(n) = s.read(&mut got) {
            out.push(String::from_utf8_lossy(&got[..n]).into_owned());
        }
    }
    out
}

fn completion_request(version: &str, extra_headers: &str, stream: bool) -> String {
    let body = serde_json::json!({ "model": MODEL, "prompt": "one two three", "max_tokens": 3, "stream": stream })
        .to_string();
    format!(
        "POST /v1/completions {version}\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{extra_headers}\r\n{body}",
        body.len()
    )
}

/// What `probe` gives once it gives it, asked every 50 ms; past `within`, a failure naming
/// `what` and the last state it saw.
async fn eventually<T>(
    within: Duration,
    what: &str,
    mut probe: impl AsyncFnMut() -> Result<T, String>,
) -> T {
    let deadline = Instant::now() + within;
    loop {
        match probe().await {
            Ok(v) => return v,
            Err(state) => assert!(Instant::now() < deadline, "{what}: {state}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A client with a prompt request is served.
async fn assert_served(gw: &Gateway) {
    let a = send(
        &client(),
        &gw.url(),
        "/v1/completions",
        &completion("hello", false),
    )
    .await;
    assert_eq!(a.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_requests_are_all_answered_in_order() {
    let w = Worker::start(&[]).await;
    let gw = Gateway::start(&[&w], "").await;
    let mut s = connect(&gw);
    let mut all = String::new();
    for i in 0..3 {
        all.push_str(&completion_request(
            "HTTP/1.1",
            &format!("X-Request-Id: pipelined-{i}\r\n"),
            false,
        ));
    }
    all.push_str(&completion_request(
        "HTTP/1.1",
        "X-Request-Id: pipelined-3\r\nConnection: close\r\n",
        false,
    ));
    s.write_all(all.as_bytes()).unwrap();
    let out = read_to_close(&mut s);
    assert_eq!(out.matches("HTTP/1.1 200").count(), 4, "{out}");
    let order: Vec<usize> = (0..4)
        .map(|i| out.find(&format!("pipelined-{i}")).unwrap())
        .collect();
    assert!(
        order.windows(2).all(|w| w[0] < w[1]),
        "answered out of order: {out}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_1_0_clients_get_no_chunked_encoding_and_a_close() {
    let w = Worker::start(&[]).await;
    let gw = Gateway::start(&[&w], "").await;
    for stream in [true, false] {
        let mut s = connect(&gw);
        s.write_all(completion_request("HTTP/1.0", "", stream).as_bytes())
            .unwrap();
        let out = read_to_close(&mut s);
        let (head, body) = out.split_once("\r\n\r\n").unwrap();
        let head = head.to_ascii_lowercase();
        assert!(
            head.starts_with("http/1.") && head.contains(" 200"),
            "{out}"
        );
        assert!(
            !head.contains("transfer-encoding"),
            "chunked to HTTP/1.0: {out}"
        );
        assert!(head.contains("connection: close"), "{out}");
        if stream {
            assert!(body.contains("data: [DONE]"), "{out}");
        } else {
            assert!(body.contains("\"choices\""), "{out}");
        }
    }
    // HTTP/1.0 asking for keep-alive may keep it for an answer of known length.
    let mut s = connect(&gw);
    s.write_all(b"GET /health HTTP/1.0\r\n\r\n").unwrap();
    assert!(read_to_close(&mut s).contains("200"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_many_headers_get_431_not_a_silent_close() {
    let w = Worker::start(&[]).await;
    let gw = Gateway::start(&[&w], "").await;
    let mut s = connect(&gw);
    let headers: String = (0..300).map(|i| format!("X-Extra-{i}: v\r\n")).collect();
    s.write_all(format!("GET /health HTTP/1.1\r\nHost: gw\r\n{headers}\r\n").as_bytes())
        .unwrap();
    let out = read_to_close(&mut s);
    assert!(out.starts_with("HTTP/1.1 431"), "{out}");
    assert!(out.contains("headers_too_large"), "{out}");
}

const SLOW_LIMITS: &str = "limits:\n  header_timeout_ms: 600\n  body_timeout_ms: 600\n";

/// Sends `bytes` one at a time, 100 ms apart, until the gateway closes; what it answered.
fn trickle(s: &mut TcpStream, bytes: &[u8]) -> String {
    s.set_nonblocking(false).unwrap();
    for &b in bytes {
        if s.write_all(&[b]).is_err() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
        // Anything back means the gateway has given up on us.
        s.set_nonblocking(true).unwrap();
        let mut peek = [0u8; 1];
        let answered =
            !matches!(s.peek(&mut peek), Err(ref e) if e.kind() == std::io::ErrorKind::WouldBlock);
        s.set_nonblocking(false).unwrap();
        if answered {
            break;
        }
    }
    read_to_close(s)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_headers_and_bodies_get_408_and_a_closed_connection() {
    let w = Worker::start(&[]).await;
    let gw = Gateway::start(&[&w], SLOW_LIMITS).await;
    let request = completion_request("HTTP/1.1", "", false);
    let (head, body) = request.split_once("\r\n\r\n").unwrap();

    // A header a byte at a time: 408 once its deadline passes, whatever the pace.
    let mut s = connect(&gw);
    let started = Instant::now();
    let out = trickle(&mut s, head.as_bytes());
    assert!(out.starts_with("HTTP/1.1 408"), "{out}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "held for {:?}",
        started.elapsed()
    );

    // A whole header, then its body a byte at a time.
    let mut s = connect(&gw);
    s.write_all(format!("{head}\r\n\r\n").as_bytes()).unwrap();
    let out = trickle(&mut s, body.as_bytes());
    assert!(out.starts_with("HTTP/1.1 408"), "{out}");
    assert!(out.contains("body_timeout_ms"), "{out}");

    // A connection that never sends anything is closed too.
    let mut s = connect(&gw);
    let out = read_to_close(&mut s);
    assert!(out.is_empty() || out.starts_with("HTTP/1.1 408"), "{out}");

    // A prompt client is untouched.
    assert_served(&gw).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_before_the_first_byte_cancels_the_upstream_request() {
    // The worker answers after 5 s; the client leaves after 300 ms.
    let w = Worker::start(&["--first-token-delay-ms", "5000"]).await;
    let gw = Gateway::start(&[&w], "").await;
    let mut s = connect(&gw);
    s.write_all(completion_request("HTTP/1.1", "", false).as_bytes())
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        w.stats().await["in_flight"],
        1,
        "the worker has the request"
    );
    drop(s);
    let stats = eventually(
        Duration::from_secs(4),
        "the upstream request was held",
        async || {
            let stats = w.stats().await;
            (stats["in_flight"] == 0)
                .then_some(stats.clone())
                .ok_or(stats.to_string())
        },
    )
    .await;
    assert_eq!(stats["completed"], 0, "it ran to the end: {stats}");
    let metrics = gw.metrics().await;
    assert!(
        metric(&metrics, "kvgate_client_disconnects_total") >= 1.0,
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_bound_get_503_and_idle_ones_are_shed_under_pressure() {
    let w = Worker::start(&[]).await;
    // The header deadline (30 s) is far above the 1 s wait under pressure.
    let gw = Gateway::start(&[&w], "limits: {max_connections: 4}\n").await;
    let idle: Vec<TcpStream> = (0..4).map(|_| connect(&gw)).collect();
    // Let the gateway count all four before the fifth comes.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut fifth = connect(&gw);
    let _ = fifth.write_all(completion_request("HTTP/1.1", "", false).as_bytes());
    let out = read_to_close(&mut fifth);
    assert!(
        out.is_empty() || out.starts_with("HTTP/1.1 503"),
        "past the bound: {out}"
    );
    // More than half the bound is open: connections that send nothing are shed, a second
    // apart, until half of it is (the header deadline, 30 s, would have kept them all).
    tokio::time::sleep(Duration::from_secs(4)).await;
    // Checks racing each other may close one more than needed.
    let shed = closed(idle);
    assert!(shed.len() >= 2, "shed down to half the bound: {shed:?}");
    for out in shed {
        assert!(out.is_empty() || out.starts_with("HTTP/1.1 408"), "{out}");
    }
    // Slots free again: a client is served.
    assert_served(&gw).await;
    let metrics = gw.metrics().await;
    assert!(
        metric(&metrics, "kvgate_connections_refused_total") >= 1.0,
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kept_alive_connections_are_shed_when_pressure_comes_later() {
    let w = Worker::start(&[]).await;
    let gw = Gateway::start(&[&w], "limits: {max_connections: 8}\n").await;
    // Four connections kept alive after a request each, at half the bound: not pressed, so
    // each may idle for the usual 60 s.
    let kept: Vec<TcpStream> = (0..4)
        .map(|_| {
            let mut s = connect(&gw);
            s.write_all(b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n")
                .unwrap();
            let mut got = Vec::new();
            let mut buf = [0u8; 512];
            while !String::from_utf8_lossy(&got).contains(r#"{"status":"ok"}"#) {
                let n = s.read(&mut buf).unwrap();
                assert!(n > 0, "closed before the answer");
                got.extend_from_slice(&buf[..n]);
            }
            s
        })
        .collect();
    // A fifth, busy sending its body, tips the gateway over half the bound; it is not idle,
    // so one of the kept-alive ones goes.
    let mut busy = connect(&gw);
    busy.write_all(
        b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{",
    )
    .unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let shed = closed(kept);
    assert!(!shed.is_empty(), "none shed");
    assert!(
        shed.iter().all(String::is_empty),
        "shed without a word: {shed:?}"
    );
    drop(busy);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_takes_none_of_its_answer_is_closed_after_the_send_timeout() {
    let w = Worker::start(&[]).await;
    let gw = Gateway::start(&[&w], "limits:\n  send_timeout_ms: 500\n").await;
    // The worker echoes the prompt's words: 200,000 chunks, far more than the sockets buffer.
    let body = serde_json::json!({
        "model": MODEL,
        "messages": [{ "role": "user", "content": "w ".repeat(200_000) }],
        "max_tokens": 200_000,
        "stream": true,
    })
    .to_string();
    let mut s = connect(&gw);
    s.write_all(
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
    .unwrap();
    // Nothing is read: once the gateway's writes stall for 500 ms it closes the connection,
    // which cancels the upstream request.
    let stats = eventually(Duration::from_secs(20), "the answer was held", async || {
        let stats = w.stats().await;
        (stats["cancelled"] == 1)
            .then_some(stats.clone())
            .ok_or(stats.to_string())
    })
    .await;
    assert_eq!(stats["completed"], 0, "{stats}");
    let metrics = gw.metrics().await;
    assert_eq!(
        metric(&metrics, "kvgate_client_send_timeouts_total"),
        1.0,
        "{metrics}"
    );
    // What the client is left with: the start of its answer, then the close.
    let got = read_to_close(&mut s);
    assert!(
        got.starts_with("HTTP/1.1 200"),
        "{}",
        &got[..got.len().min(200)]
    );
    assert!(!got.contains("[DONE]"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h2_client_that_stops_reading_is_closed_after_the_send_timeout() {
    // A sim worker a hundred times faster than the profile: 120,000 tokens in under 20 s.
    let w = SimWorker::start(&["--max-model-len", "131072", "--time-scale", "0.01"]).await;
    let gw = Gateway::start(&[&w], "limits:\n  send_timeout_ms: 500\n").await;
    let body = serde_json::json!({
        "model": MODEL,
        "messages": [{ "role": "user", "content": "hi" }],
        "max_tokens": 120_000,
        "stream": true,
    })
    .to_string();
    // curl reads 1 KB a second: its HTTP/2 windows fill and the gateway's writes wait.
    let mut curl = tokio::process::Command::new("curl")
        .args(["-s", "--http2-prior-knowledge", "--limit-rate", "1k"])
        .args([
            "--max-time",
            "60",
            "-o",
            "/dev/null",
            "-H",
            "content-type: application/json",
        ])
        .args(["-d", &body, &format!("{}/v1/chat/completions", gw.url())])
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    eventually(Duration::from_secs(30), "no send timeout", async || {
        let gateway = gw.metrics().await;
        (metric(&gateway, "kvgate_client_send_timeouts_total") == 1.0)
            .then_some(())
            .ok_or(gateway)
    })
    .await;
    // The generation stopped with the stream, short of its 120,000 tokens.
    let worker = eventually(Duration::from_secs(5), "still generating", async || {
        let worker = w.metrics().await;
        (metric(&worker, "kvgate_worker_requests_running") == 0.0)
            .then_some(worker.clone())
            .ok_or(worker)
    })
    .await;
    assert!(metric(&worker, "kvgate_worker_generation_tokens_total") < 120_000.0);
    curl.kill().await.unwrap();
}
