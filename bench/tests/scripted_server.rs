//! The bench's metrics against a scripted server with known timings: a raw HTTP/1.1 server
//! that answers every chat request with an empty role chunk at once (the TTFT trap), the
//! first token after 80 ms, then one every 30 ms, and a usage chunk; every fifth request gets
//! 503. The bench must recover TTFT, ITL, TPOT, end-to-end and the token counts.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvgate_bench::{BenchConfig, Load, Slo, Workload};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const FIRST_MS: u64 = 80;
const GAP_MS: u64 = 30;

async fn serve(listener: TcpListener) {
    let mut served = 0u64;
    loop {
        let (stream, _) = listener.accept().await.unwrap();
        served += 1;
        tokio::spawn(connection(stream, served * 1000));
    }
}

/// Reads requests off one keep-alive connection and answers each.
async fn connection(mut s: TcpStream, id: u64) {
    let mut buf = Vec::new();
    let mut n = id;
    loop {
        let Some((head_end, length)) = read_head(&mut s, &mut buf).await else {
            return;
        };
        while buf.len() < head_end + length {
            let mut chunk = [0u8; 4096];
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(k) => buf.extend_from_slice(&chunk[..k]),
            }
        }
        let body: serde_json::Value =
            serde_json::from_slice(&buf[head_end..head_end + length]).unwrap();
        buf.drain(..head_end + length);
        n += 1;
        if n.is_multiple_of(5) {
            let msg = "{\"error\":{\"message\":\"busy\"}}";
            let r = format!("HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{msg}", msg.len());
            if s.write_all(r.as_bytes()).await.is_err() {
                return;
            }
            continue;
        }
        let tokens = body["max_tokens"].as_u64().unwrap();
        let prompt_words: usize = body["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["content"].as_str().unwrap().split_whitespace().count())
            .sum();
        let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\nx-kvgate-replica: scripted\r\n\r\n";
        if s.write_all(head.as_bytes()).await.is_err() {
            return;
        }
        let send = |data: String| {
            let event = format!("data: {data}\n\n");
            format!("{:x}\r\n{event}\r\n", event.len())
        };
        let role = send(r#"{"choices":[{"delta":{"role":"assistant","content":""}}]}"#.into());
        let _ = s.write_all(role.as_bytes()).await;
        tokio::time::sleep(Duration::from_millis(FIRST_MS)).await;
        for t in 0..tokens {
            if t > 0 {
                tokio::time::sleep(Duration::from_millis(GAP_MS)).await;
            }
            let chunk = send(format!(
                r#"{{"choices":[{{"delta":{{"content":"w{t} "}}}}]}}"#
            ));
            let _ = s.write_all(chunk.as_bytes()).await;
        }
        let usage = send(format!(
            r#"{{"choices":[],"usage":{{"prompt_tokens":{prompt_words},"completion_tokens":{tokens},"prompt_tokens_details":{{"cached_tokens":4}}}}}}"#
        ));
        let done = send("[DONE]".into());
        let _ = s
            .write_all(format!("{usage}{done}0\r\n\r\n").as_bytes())
            .await;
    }
}

/// Reads until the end of a request head; returns its length and the body's.
async fn read_head(s: &mut TcpStream, buf: &mut Vec<u8>) -> Option<(usize, usize)> {
    loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..i]).to_lowercase();
            let length = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            return Some((i + 4, length));
        }
        let mut chunk = [0u8; 4096];
        match s.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(k) => buf.extend_from_slice(&chunk[..k]),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_match_the_script() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(serve(listener));
    let out = std::env::temp_dir().join(format!("kvgate-bench-test-{}", std::process::id()));
    let config = BenchConfig {
        urls: vec![url],
        model: Some("scripted".into()),
        workload: Workload::Random {
            input_mean: 20.0,
            input_sigma: 0.0,
            output_mean: 5.0,
            output_sigma: 0.0,
        },
        load: Load::Concurrency(2),
        requests: 12,
        warmup: 2,
        duration: None,
        seed: 3,
        slo: Slo {
            ttft_s: Some(0.5),
            ..Slo::default()
        },
        headers: vec![],
        group_header: None,
        out: out.clone(),
        labels: [("config".to_string(), "scripted".to_string())].into(),
        command: "test".into(),
        progress: false,
    };
    let s = kvgate_bench::run(config).await.unwrap();
    let (first, gap) = (FIRST_MS as f64 / 1e3, GAP_MS as f64 / 1e3);
    // Scheduling on a shared machine adds a little; nothing should take less than scripted.
    let near = |got: f64, want: f64, what: &str| {
        assert!(
            got >= want - 0.002 && got <= want + 0.025,
            "{what}: {got} vs {want}"
        );
    };
    near(
        s.ttft_s.p50,
        first,
        "TTFT p50 (the empty role chunk is not the first token)",
    );
    near(s.itl_s.p50, gap, "ITL p50");
    near(s.tpot_s.p50, gap, "TPOT p50");
    near(s.e2e_s.p50, first + 4.0 * gap, "e2e p50");
    assert_eq!(
        s.itl_s.count,
        s.requests * 4,
        "four gaps per five-token answer, pooled"
    );
    // 12 sent, 2 warm-up; every fifth request on a connection fails.
    assert_eq!(s.requests + s.failed + s.warmup, 12);
    assert!(s.failed >= 1, "{s:?}");
    assert_eq!(s.output_tokens, 5 * s.requests as u64);
    assert_eq!(
        s.prompt_tokens,
        20 * s.requests as u64,
        "prompt tokens from usage"
    );
    assert_eq!(s.cached_tokens, 4 * s.requests as u64);
    assert_eq!(s.requests_per_replica.get("scripted"), Some(&s.requests));
    assert!(s
        .goodput_requests_per_s
        .is_some_and(|g| (g - s.requests_per_s).abs() < 1e-9));
    assert_eq!(s.labels.get("config").map(String::as_str), Some("scripted"));
    let csv = std::fs::read_to_string(out.join("requests.csv")).unwrap();
    assert_eq!(csv.lines().count(), 13, "a header and one row per request");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    for key in ["ttft_s", "tpot_s", "itl_s", "e2e_s"] {
        for p in ["mean", "p50", "p90", "p99"] {
            assert!(json[key][p].is_f64(), "{key}.{p}");
        }
    }
    for key in [
        "requests_per_s",
        "output_tokens_per_s",
        "cached_token_ratio",
    ] {
        assert!(json[key].is_f64(), "{key}");
    }
    assert!(std::fs::read_to_string(out.join("ttft_cdf.svg"))
        .unwrap()
        .starts_with("<svg"));
    std::fs::remove_dir_all(&out).ok();
}
