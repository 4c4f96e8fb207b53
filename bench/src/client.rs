//! One streamed chat request, timed: when it was sent, when each chunk with content arrived,
//! and what the server's `usage` says. HTTP/1.1 with pooled keep-alive connections.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::rt::TokioExecutor;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

#[derive(Clone)]
pub struct Client {
    http: HyperClient<HttpConnector, Full<Bytes>>,
    /// Every server's base URL; requests take turns over them (several gateways in front of
    /// one fleet, as a client-side balancer would spread them).
    bases: Arc<[String]>,
    next: Arc<AtomicUsize>,
    headers: Vec<(String, String)>,
    /// Carries each request's prefix group, when named.
    group_header: Option<String>,
}

/// What one request did; times in seconds from when it was sent.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Outcome {
    pub status: u16,
    /// Arrival of each chunk that carried content (the first one is the TTFT).
    pub content_times: Vec<f64>,
    pub e2e: f64,
    pub answer: String,
    pub prompt_tokens: Option<u64>,
    pub output_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    /// The gateway's `x-kvgate-replica` header.
    pub replica: Option<String>,
    /// The gateway's `x-kvgate-route` header (its scores, when asked with `x-kvgate-debug: 1`).
    pub route: Option<String>,
    pub error: Option<String>,
}

/// A chat message.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Message {
    pub role: &'static str,
    pub content: String,
}

impl Client {
    /// `bases` are `http://HOST:PORT` (at least one); `headers` go with every request.
    pub fn new(
        bases: &[String],
        headers: Vec<(String, String)>,
        group_header: Option<String>,
    ) -> Client {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let http = HyperClient::builder(TokioExecutor::new())
            .pool_max_idle_per_host(1024)
            .build(connector);
        Client {
            http,
            bases: bases
                .iter()
                .map(|b| b.trim_end_matches('/').to_string())
                .collect(),
            next: Arc::new(AtomicUsize::new(0)),
            headers,
            group_header,
        }
    }

    /// The server the next request goes to: each in turn.
    fn next_base(&self) -> &str {
        &self.bases[self.next.fetch_add(1, Ordering::Relaxed) % self.bases.len()]
    }

    /// The first model of `GET /v1/models`.
    pub async fn first_model(&self) -> Result<String, String> {
        let base = &self.bases[0];
        let req = http::Request::get(format!("{base}/v1/models"))
            .body(Full::new(Bytes::new()))
            .map_err(|e| e.to_string())?;
        let resp = self
            .http
            .request(req)
            .await
            .map_err(|e| format!("{base}: {e}"))?;
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        let v: serde_json::Value =
            serde_json::from_slice(&body).map_err(|e| format!("/v1/models: {e}"))?;
        v["data"][0]["id"]
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| format!("/v1/models lists no model: {v}"))
    }

    /// Sends a streamed chat completion and times it.
    pub async fn chat(
        &self,
        model: &str,
        messages: &[Message],
        max_tokens: u32,
        session: Option<&str>,
        group: Option<&str>,
    ) -> Outcome {
        let body = serde_json::json!({
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "ignore_eos": true,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        let mut req = http::Request::post(format!("{}/v1/chat/completions", self.next_base()))
            .header("content-type", "application/json")
            .header("x-kvgate-debug", "1");
        for (k, v) in &self.headers {
            req = req.header(k.as_str(), v.as_str());
        }
        if let Some(s) = session {
            req = req.header("x-session-id", s);
        }
        if let (Some(name), Some(g)) = (&self.group_header, group) {
            req = req.header(name.as_str(), g);
        }
        let started = Instant::now();
        let mut out = Outcome::default();
        let req = match req.body(Full::new(Bytes::from(body.to_string()))) {
            Ok(r) => r,
            Err(e) => {
                out.error = Some(e.to_string());
                return out;
            }
        };
        let resp = match self.http.request(req).await {
            Ok(r) => r,
            Err(e) => {
                out.error = Some(format!("request failed: {e}"));
                out.e2e = started.elapsed().as_secs_f64();
                return out;
            }
        };
        out.status = resp.status().as_u16();
        let header = |name| {
            resp.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        out.replica = header("x-kvgate-replica");
        out.route = header("x-kvgate-route");
        let mut body = resp.into_body();
        let mut events = kvgate_protocol::sse::SseParser::default();
        let mut error_body = Vec::new();
        while let Some(frame) = body.frame().await {
            let bytes = match frame {
                Ok(f) => match f.into_data() {
                    Ok(b) => b,
                    Err(_) => continue,
                },
                Err(e) => {
                    out.error = Some(format!("stream broke: {e}"));
                    break;
                }
            };
            let now = started.elapsed().as_secs_f64();
            if out.status != 200 {
                error_body.extend_from_slice(&bytes);
                continue;
            }
            for data in events.push(&bytes) {
                take_event(&data, now, &mut out);
            }
        }
        out.e2e = started.elapsed().as_secs_f64();
        if out.status != 200 && out.error.is_none() {
            out.error = Some(format!(
                "status {}: {}",
                out.status,
                String::from_utf8_lossy(&error_body)
                    .chars()
                    .take(300)
                    .collect::<String>()
            ));
        }
        out
    }
}

/// Folds one SSE `data:` payload, which arrived at `now`, into `out`.
fn take_event(data: &str, now: f64, out: &mut Outcome) {
    if data == "[DONE]" {
        return;
    }
    let Ok(v) = serde_json::from_str::<serde_json::Value>(data) else {
        out.error = Some(format!("unparsable event: {data}"));
        return;
    };
    if let Some(e) = v.get("error") {
        out.error = Some(format!("error event: {e}"));
        return;
    }
    if let Some(text) = v["choices"][0]["delta"]["content"]
        .as_str()
        .filter(|t| !t.is_empty())
    {
        out.content_times.push(now);
        out.answer.push_str(text);
    }
    let usage = &v["usage"];
    if usage.is_object() {
        out.prompt_tokens = usage["prompt_tokens"].as_u64();
        out.output_tokens = usage["completion_tokens"].as_u64();
        out.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"].as_u64();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_fold_into_the_outcome() {
        let mut out = Outcome::default();
        take_event(
            r#"{"choices":[{"delta":{"role":"assistant","content":""}}]}"#,
            0.1,
            &mut out,
        );
        assert!(
            out.content_times.is_empty(),
            "an empty chunk is not a token"
        );
        take_event(r#"{"choices":[{"delta":{"content":"hi"}}]}"#, 0.2, &mut out);
        take_event(
            r#"{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":3}}}"#,
            0.3,
            &mut out,
        );
        assert_eq!(out.content_times, vec![0.2]);
        assert_eq!(
            (out.prompt_tokens, out.output_tokens, out.cached_tokens),
            (Some(5), Some(1), Some(3))
        );
    }
}
