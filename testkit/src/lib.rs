//! A fault-injection OpenAI-compatible worker for testing the gateway (not the product's
//! worker): it streams deterministic tokens (the prompt's last user text, echoed) with
//! configurable delays, error rate, hangs and mid-stream disconnects, reports a digest of every
//! request body it receives, keeps the last bodies for `GET /received` (what a gateway sent
//! it, field by field), and counts what happened in `GET /stats`.

mod faults;
mod generate;

pub use faults::{Fate, Faults};

use bytes::Bytes;
use generate::{plan, Endpoint, Job};
use http::{Method, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use kvgate_protocol::openai::ModelList;
use kvgate_protocol::{ApiError, ErrorKind};
use kvgate_worker::server::body::{full, ChannelBody, Chunk};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::sync::mpsc;

/// Largest request body the worker reads.
const MAX_BODY: usize = 64 << 20;
/// How long an injected disconnect waits for the tokens before it to be sent.
const DISCONNECT_AFTER_SENT: Duration = Duration::from_millis(20);
/// Request bodies kept for `GET /received`, the latest ones.
const RECEIVED: usize = 64;

#[derive(Debug, Clone)]
pub struct WorkerConfig {
    pub addr: SocketAddr,
    pub id: String,
    pub model: String,
    /// Seeds the fault draws.
    pub seed: u64,
    pub faults: Faults,
    /// Each streamed token chunk starts with an SSE comment `: sent_ns=N`, N the wall clock in
    /// nanoseconds since the Unix epoch when the chunk was handed to the connection: what a
    /// proxy's delay per chunk is measured by.
    pub stamp_chunks: bool,
}

#[derive(Default)]
struct Counters {
    requests: AtomicU64,
    in_flight: AtomicU64,
    max_in_flight: AtomicU64,
    completed: AtomicU64,
    cancelled: AtomicU64,
    errors: AtomicU64,
}

struct State {
    config: WorkerConfig,
    faults: Mutex<Faults>,
    counters: Counters,
    /// The latest generation request bodies, oldest first (JSON, or a string if not JSON).
    received: Mutex<std::collections::VecDeque<serde_json::Value>>,
}

/// Counts a generation in flight until dropped.
struct Active(Arc<State>);

impl Active {
    fn new(state: Arc<State>) -> Self {
        let c = &state.counters;
        let now = c.in_flight.fetch_add(1, Ordering::AcqRel) + 1;
        c.max_in_flight.fetch_max(now, Ordering::AcqRel);
        Active(state)
    }
}

impl Drop for Active {
    fn drop(&mut self) {
        self.0.counters.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Serves until the process ends.
pub async fn serve(config: WorkerConfig) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(config.addr).await?;
    let faults = Mutex::new(config.faults.clone());
    let state = Arc::new(State {
        config,
        faults,
        counters: Counters::default(),
        received: Mutex::default(),
    });
    tracing::info!(addr = %state.config.addr, id = %state.config.id, "fault-injection worker listening");
    loop {
        let (stream, _) = listener.accept().await?;
        // Streams are many small writes: Nagle's algorithm would hold each behind the last ACK.
        let _ = stream.set_nodelay(true);
        let state = Arc::clone(&state);
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| handle(Arc::clone(&state), req));
            let io = hyper_util::rt::TokioIo::new(stream);
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .serve_connection(io, service)
                .await
            {
                tracing::debug!(error = %e, "connection ended");
            }
        });
    }
}

type Reply = Response<ChannelBody>;

async fn handle(
    state: Arc<State>,
    req: Request<Incoming>,
) -> Result<Reply, std::convert::Infallible> {
    let path = req.uri().path().to_string();
    let reply = match (req.method(), path.as_str()) {
        (&Method::GET, "/health") => {
            let healthy = state
                .faults
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .healthy;
            json(
                if healthy { 200 } else { 503 },
                serde_json::json!({ "healthy": healthy }),
            )
        }
        (&Method::GET, "/v1/models") => {
            let list = ModelList::new([state.config.model.clone()]);
            json(200, serde_json::to_value(list).unwrap_or_default())
        }
        (&Method::GET, "/stats") => json(200, stats(&state)),
        (&Method::GET, "/received") => {
            let received = state
                .received
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            json(200, serde_json::Value::from(Vec::from(received.clone())))
        }
        (&Method::POST, "/fault") => set_faults(&state, req).await,
        (&Method::POST, "/v1/chat/completions") => generate(state, req, Endpoint::Chat).await,
        (&Method::POST, "/v1/completions") => generate(state, req, Endpoint::Completions).await,
        _ => error(&ApiError::new(
            ErrorKind::NotFound,
            format!("no route for {path}"),
        )),
    };
    Ok(reply)
}

fn stats(state: &State) -> serde_json::Value {
    let c = &state.counters;
    let get = |a: &AtomicU64| a.load(Ordering::Acquire);
    serde_json::json!({
        "id": state.config.id,
        "requests": get(&c.requests),
        "in_flight": get(&c.in_flight),
        "max_in_flight": get(&c.max_in_flight),
        "completed": get(&c.completed),
        "cancelled": get(&c.cancelled),
        "errors": get(&c.errors),
    })
}

async fn set_faults(state: &State, req: Request<Incoming>) -> Reply {
    let Ok(body) = req.into_body().collect().await.map(|b| b.to_bytes()) else {
        return error(&ApiError::new(ErrorKind::InvalidRequest, "unreadable body"));
    };
    match serde_json::from_slice::<Faults>(&body) {
        Ok(faults) => {
            *state.faults.lock().unwrap_or_else(PoisonError::into_inner) = faults.clone();
            json(200, serde_json::to_value(faults).unwrap_or_default())
        }
        Err(e) => error(&ApiError::new(
            ErrorKind::InvalidRequest,
            format!("invalid faults: {e}"),
        )),
    }
}

async fn generate(state: Arc<State>, req: Request<Incoming>, endpoint: Endpoint) -> Reply {
    let n = state.counters.requests.fetch_add(1, Ordering::AcqRel);
    let request_id = req
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let body = match http_body_util::Limited::new(req.into_body(), MAX_BODY)
        .collect()
        .await
    {
        Ok(b) => b.to_bytes(),
        Err(e) => {
            return error(&ApiError::new(
                ErrorKind::PayloadTooLarge,
                format!("body: {e}"),
            ))
        }
    };
    let digest = format!("{:032x}", xxhash_rust::xxh3::xxh3_128(&body));
    {
        let value = serde_json::from_slice(&body)
            .unwrap_or_else(|_| String::from_utf8_lossy(&body).into_owned().into());
        let mut received = state
            .received
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if received.len() == RECEIVED {
            received.pop_front();
        }
        received.push_back(value);
    }
    let active = Active::new(Arc::clone(&state));
    let faults = state
        .faults
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone();
    let fate = faults.fate(state.config.seed, n);
    let job = match fate {
        Fate::Error(status) => {
            state.counters.errors.fetch_add(1, Ordering::AcqRel);
            let kind = if status == 429 {
                ErrorKind::RateLimited
            } else {
                ErrorKind::Unavailable
            };
            let mut reply = error(&ApiError::new(kind, format!("injected {status}")));
            *reply.status_mut() =
                StatusCode::from_u16(status).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
            return reply;
        }
        Fate::Hang => {
            tokio::time::sleep(Duration::from_secs(3600)).await;
            return error(&ApiError::new(ErrorKind::Internal, "hung"));
        }
        Fate::Garbage => {
            // Events whose data is no JSON, then noise without framing.
            let noise: String = digest.chars().cycle().take(300).collect();
            let body = format!("data: {noise}\n\ndata: {{\"choices\": [\n\n{noise}");
            return with_headers(Response::new(full(body)), "text/event-stream", &[]);
        }
        Fate::Serve | Fate::DisconnectAfter(_) => {
            match plan(endpoint, &body, format!("cmpl-{}-{n}", state.config.id)) {
                Ok(job) => job,
                Err(e) => return error(&e),
            }
        }
    };
    let headers = [
        ("x-worker-id", state.config.id.clone()),
        ("x-body-digest", digest),
        ("x-request-id", request_id),
    ];
    let first = Duration::from_millis(faults.first_token_delay_ms);
    let gap = Duration::from_millis(faults.token_delay_ms);
    if !job.stream {
        tokio::time::sleep(first + gap * job.tokens.len().saturating_sub(1) as u32).await;
        state.counters.completed.fetch_add(1, Ordering::AcqRel);
        drop(active);
        return with_headers(
            Response::new(full(job.response())),
            "application/json",
            &headers,
        );
    }
    let (tx, rx) = mpsc::channel::<Chunk>(4);
    let cut = match fate {
        Fate::DisconnectAfter(k) => Some(k as usize),
        _ => None,
    };
    tokio::spawn(stream(job, tx, first, gap, cut, active));
    with_headers(
        Response::new(ChannelBody(rx)),
        "text/event-stream",
        &headers,
    )
}

async fn stream(
    job: Job,
    tx: mpsc::Sender<Chunk>,
    first: Duration,
    gap: Duration,
    cut: Option<usize>,
    active: Active,
) {
    let counters = &active.0.counters;
    let stamp = active.0.config.stamp_chunks;
    let send = |text: String| tx.send(Ok(Frame::data(Bytes::from(text))));
    // A zero sleep still waits for the timer's next tick (a millisecond).
    if !first.is_zero() {
        tokio::time::sleep(first).await;
    }
    for (i, token) in job.tokens.iter().enumerate() {
        if i > 0 && !gap.is_zero() {
            tokio::time::sleep(gap).await;
        }
        if cut == Some(i) {
            // Abort the connection mid-stream, once the tokens sent so far are out: an abort
            // resets the connection, and a reset drops what the peer has not read yet.
            tokio::time::sleep(DISCONNECT_AFTER_SENT).await;
            let _ = tx
                .send(Err(std::io::Error::other("injected disconnect")))
                .await;
            return;
        }
        let mut chunk = job.chunk(Some(token), None);
        if stamp {
            chunk.insert_str(0, &format!(": sent_ns={}\n", unix_nanos()));
        }
        if send(chunk).await.is_err() {
            counters.cancelled.fetch_add(1, Ordering::AcqRel);
            return;
        }
    }
    let mut tail = job.chunk(None, Some(job.finish_reason));
    if job.include_usage {
        tail.push_str(&job.usage_chunk());
    }
    tail.push_str(kvgate_protocol::openai::SSE_DONE);
    if send(tail).await.is_ok() {
        counters.completed.fetch_add(1, Ordering::AcqRel);
    } else {
        counters.cancelled.fetch_add(1, Ordering::AcqRel);
    }
}

fn unix_nanos() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

fn json(status: u16, value: serde_json::Value) -> Reply {
    let mut reply = Response::new(full(value.to_string()));
    *reply.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    with_headers(reply, "application/json", &[])
}

fn error(e: &ApiError) -> Reply {
    let mut reply = json(200, serde_json::Value::Null);
    *reply.body_mut() = full(e.to_json());
    *reply.status_mut() =
        StatusCode::from_u16(e.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    reply
}

fn with_headers(mut reply: Reply, content_type: &str, headers: &[(&str, String)]) -> Reply {
    let h = reply.headers_mut();
    if let Ok(v) = content_type.parse() {
        h.insert(http::header::CONTENT_TYPE, v);
    }
    for (name, value) in headers {
        if let (Ok(n), Ok(v)) = (http::HeaderName::from_bytes(name.as_bytes()), value.parse()) {
            h.insert(n, v);
        }
    }
    reply
}
