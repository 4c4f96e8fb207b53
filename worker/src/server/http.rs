//! HTTP routes: OpenAI generation, models, health, tokenize, metrics, stats and KV events.

use super::body::{full, ChannelBody, Chunk};
use super::choices::Choices;
use super::disagg::{self, Leg};
use super::engine_loop::{Command, Shared};
use super::generation::{prepare, response, Finished, Generation, Piece};
use crate::engine::EngineError;
use crate::model::ModelFile;
use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use kvgate_protocol::openai::{ChatMessage, Endpoint, GenerationRequest, ModelList, Usage};
use kvgate_protocol::responses::Responder;
use kvgate_protocol::worker_stats::WorkerStats;
use kvgate_protocol::{ApiError, ErrorKind};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, PoisonError};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

/// Largest request body read.
pub const MAX_BODY_BYTES: usize = 64 << 20;

pub struct Context {
    pub model: Arc<ModelFile>,
    pub served_name: String,
    /// Adapters served besides the base model (sim backend).
    pub adapters: std::sync::Mutex<super::adapters::AdapterSet>,
    pub max_model_len: usize,
    pub commands: mpsc::Sender<Command>,
    pub shared: Arc<Shared>,
    pub next_id: AtomicU64,
    /// Requests parsed and tokenized at once, each on a blocking thread (see [`apart`]).
    pub prepare_slots: tokio::sync::Semaphore,
    /// Prefill/decode roles (`None`: a colocated worker).
    pub disagg: Option<super::disagg::Disagg>,
    /// How long a request's body may take to arrive after its header.
    pub body_timeout: Duration,
}

type Reply = Response<ChannelBody>;

/// Answers `req`, which reached this worker at `local_ip`.
pub async fn handle(
    ctx: Arc<Context>,
    req: Request<Incoming>,
    local_ip: std::net::IpAddr,
) -> Result<Reply, std::convert::Infallible> {
    let path = req.uri().path().to_string();
    let query = req.uri().query().unwrap_or("").to_string();
    let reply = match (req.method().clone(), path.as_str()) {
        (Method::POST, "/v1/chat/completions") => {
            generate(ctx, req, Endpoint::Chat, local_ip).await
        }
        (Method::POST, "/v1/completions") => {
            generate(ctx, req, Endpoint::Completions, local_ip).await
        }
        (Method::GET, "/v1/models") => {
            let adapters = ctx
                .adapters
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .resident()
                .to_vec();
            json(
                200,
                &ModelList::new(std::iter::once(ctx.served_name.clone()).chain(adapters)),
            )
        }
        (Method::GET, "/health") => json(200, &serde_json::json!({ "status": "ok" })),
        (Method::GET, "/metrics") => {
            if let Some(d) = &ctx.disagg {
                d.record_waiting(&ctx.shared.metrics);
            }
            let mut r = Response::new(full(ctx.shared.metrics.render()));
            r.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("text/plain; version=0.0.4"),
            );
            r
        }
        (Method::GET, "/stats") => stats(&ctx),
        (Method::GET, "/kv/snapshot") => snapshot(&ctx).await,
        (Method::GET, "/kv/events") => events(&ctx, &query),
        (Method::POST, "/tokenize") => tokenize(&ctx, req).await,
        (Method::POST, "/reset_prefix_cache") => {
            match ctx.commands.send(Command::ResetPrefixCache).await {
                Ok(()) => json(200, &serde_json::json!({ "status": "ok" })),
                Err(_) => error(&ApiError::new(
                    ErrorKind::Unavailable,
                    "the engine has stopped",
                )),
            }
        }
        (Method::POST, "/detokenize") => detokenize(&ctx, req).await,
        (_, p) => error(&ApiError::new(
            ErrorKind::NotFound,
            format!("no route for {p}"),
        )),
    };
    Ok(reply)
}

/// The request's whole body, if it arrives `within` this long (hyper then closes the
/// connection, its body unread).
async fn read_body(req: Request<Incoming>, within: Duration) -> Result<Bytes, ApiError> {
    let read = http_body_util::Limited::new(req.into_body(), MAX_BODY_BYTES).collect();
    let Ok(read) = tokio::time::timeout(within, read).await else {
        return Err(ApiError::new(
            ErrorKind::RequestTimeout,
            format!("request body not received within {} ms", within.as_millis()),
        ));
    };
    read.map(|b| b.to_bytes()).map_err(|e| {
        ApiError::new(
            ErrorKind::PayloadTooLarge,
            format!("request body over {MAX_BODY_BYTES} bytes or unreadable: {e}"),
        )
    })
}

/// Runs `work` on a blocking thread, at most `prepare_slots` at once, so that parsing and
/// tokenizing a long prompt (seconds of work) never holds up `/health` or other requests on
/// the async threads.
async fn apart<T: Send + 'static>(
    ctx: &Arc<Context>,
    work: impl FnOnce(&Context) -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let stopped = || ApiError::new(ErrorKind::Unavailable, "the worker is stopping");
    let _slot = ctx.prepare_slots.acquire().await.map_err(|_| stopped())?;
    let ctx = Arc::clone(ctx);
    tokio::task::spawn_blocking(move || work(&ctx))
        .await
        .map_err(|_| stopped())?
}

async fn generate(
    ctx: Arc<Context>,
    req: Request<Incoming>,
    endpoint: Endpoint,
    local_ip: std::net::IpAddr,
) -> Reply {
    let body = match read_body(req, ctx.body_timeout).await {
        Ok(b) => b,
        Err(e) => return error(&e),
    };
    let prepared = apart(&ctx, move |ctx| {
        let serves = |name: &str| {
            name == ctx.served_name
                || ctx
                    .adapters
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .admit(name)
        };
        prepare(
            endpoint,
            &body,
            &ctx.model,
            &ctx.served_name,
            serves,
            ctx.max_model_len,
        )
    })
    .await;
    let prepared = match prepared {
        Ok(p) => p,
        Err(e) => return error(&e),
    };
    let transfer = prepared.kv_transfer_params.as_ref();
    let leg = match disagg::leg(ctx.disagg.as_ref(), transfer, prepared.stream, prepared.n) {
        Ok(leg) => leg,
        Err(e) => return error(&e),
    };
    if let Leg::Decode { host, port, id } = &leg {
        disagg::pull_prefix(&ctx, &prepared.prompt, host, *port, *id).await;
    }
    let choices = match Choices::start(&ctx, &prepared).await {
        Ok(c) => c,
        Err(e) => return error(&e.into()),
    };
    ctx.shared.metrics.requests.inc();
    let prefix = if endpoint == Endpoint::Chat {
        "chatcmpl"
    } else {
        "cmpl"
    };
    let id = format!("{prefix}-{}", choices.first_id());
    let responder = Responder::new(prepared.endpoint, id, prepared.model.clone());
    let generations: Vec<Generation> = (0..choices.len() as u32)
        .map(|index| Generation::new(responder.clone(), index, &prepared))
        .collect();
    if prepared.stream {
        return stream(ctx, choices, generations);
    }
    match whole(&ctx, choices, generations).await {
        Ok(body) if leg == Leg::Prefill => {
            let body = disagg::offer(&ctx, &prepared.prompt, body, local_ip).await;
            with_type(Response::new(full(body)), "application/json")
        }
        Ok(body) => with_type(Response::new(full(body)), "application/json"),
        Err(e) => error(&e),
    }
}

fn dropped() -> ApiError {
    ApiError::new(ErrorKind::Internal, "the engine dropped the request")
}

/// The response's body once every choice has finished.
async fn whole(
    ctx: &Context,
    mut choices: Choices,
    mut generations: Vec<Generation>,
) -> Result<Vec<u8>, ApiError> {
    let mut texts = vec![String::new(); generations.len()];
    let mut finished: Vec<Option<Finished>> = generations.iter().map(|_| None).collect();
    let mut usage: Option<Usage> = None;
    while let Some((i, token)) = choices.next().await {
        for piece in generations[i].on_token(&token, &ctx.model, &ctx.shared.metrics) {
            match piece {
                Piece::Text(t) => texts[i].push_str(&t),
                Piece::Finished { reason, usage: u } => {
                    choices.close(i);
                    Usage::add_choice(&mut usage, u);
                    let text = std::mem::take(&mut texts[i]);
                    finished[i] = Some(Finished { text, reason });
                }
            }
        }
        if choices.all_closed() {
            let finished = finished.into_iter().flatten().collect();
            return Ok(response(
                &mut generations,
                finished,
                usage.unwrap_or_default(),
            ));
        }
    }
    Err(dropped())
}

/// Every choice's chunks as they come, then the usage chunk (if asked) and `[DONE]`.
fn stream(ctx: Arc<Context>, mut choices: Choices, mut generations: Vec<Generation>) -> Reply {
    let (out_tx, out_rx) = mpsc::channel::<Chunk>(16);
    tokio::spawn(async move {
        let send = |s: String| out_tx.send(Ok(Frame::data(Bytes::from(s))));
        let mut usage: Option<Usage> = None;
        while let Some((i, token)) = choices.next().await {
            for piece in generations[i].on_token(&token, &ctx.model, &ctx.shared.metrics) {
                let event = match piece {
                    Piece::Text(t) => generations[i].text_event(t),
                    Piece::Finished { reason, usage: u } => {
                        choices.close(i);
                        Usage::add_choice(&mut usage, u);
                        generations[i].finish_event(reason)
                    }
                };
                if send(event).await.is_err() {
                    // The client left: dropping `choices` aborts what still runs.
                    return;
                }
            }
            if choices.all_closed() {
                let _ = send(generations[0].closing_events(usage.unwrap_or_default())).await;
                return;
            }
        }
        let e = dropped();
        let _ = send(kvgate_protocol::openai::sse_event(
            &String::from_utf8_lossy(&e.to_json()),
        ))
        .await;
    });
    let mut r = Response::new(ChannelBody(out_rx));
    r.headers_mut().insert(
        http::header::CACHE_CONTROL,
        http::HeaderValue::from_static("no-cache"),
    );
    with_type(r, "text/event-stream")
}

pub(super) fn engine_error(e: EngineError) -> ApiError {
    let param = match e {
        EngineError::PromptTooLong { .. } | EngineError::EmptyPrompt => Some("prompt"),
        EngineError::DuplicateId(_) | EngineError::CacheBelowContext { .. } => None,
    };
    let error = ApiError::new(ErrorKind::InvalidRequest, e.to_string());
    match param {
        Some(p) => error.with_param(p),
        None => error,
    }
}

fn stats(ctx: &Context) -> Reply {
    let stats = ctx.shared.stats();
    let adapters = ctx
        .adapters
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone();
    let last_seq = ctx
        .shared
        .events
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .last_seq();
    json(
        200,
        &WorkerStats {
            model: ctx.served_name.clone(),
            adapters: adapters.resident().to_vec(),
            adapter_slots_free: adapters.slots_free(),
            max_loras: adapters.max_loras(),
            max_model_len: ctx.max_model_len,
            engine: stats,
            kv_events_seq: last_seq,
        },
    )
}

async fn snapshot(ctx: &Context) -> Reply {
    let (tx, rx) = oneshot::channel();
    if ctx.commands.send(Command::Snapshot(tx)).await.is_err() {
        return error(&ApiError::new(
            ErrorKind::Unavailable,
            "the engine has stopped",
        ));
    }
    match rx.await {
        Ok(snapshot) => json(200, &snapshot),
        Err(_) => error(&ApiError::new(
            ErrorKind::Unavailable,
            "the engine has stopped",
        )),
    }
}

/// `GET /kv/events?from=SEQ[&follow=false]`: NDJSON batches from `from` (default: the next
/// one), then live; with `follow=false` the body ends after the retained ones (agents poll
/// this way once per report). 410 when `from` is no longer retained or is past the log (the
/// worker restarted): take `/kv/snapshot` and replay from its `seq + 1`.
fn events(ctx: &Context, query: &str) -> Reply {
    let param = |name: &str| {
        query
            .split('&')
            .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
    };
    let from = param("from").map(str::parse::<u64>);
    let follow = match param("follow") {
        None | Some("true") | Some("1") => true,
        Some("false") | Some("0") => false,
        Some(_) => {
            return error(
                &ApiError::new(ErrorKind::InvalidRequest, "`follow` must be true or false")
                    .with_param("follow"),
            )
        }
    };
    let log = ctx
        .shared
        .events
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    let from = match from {
        None => log.last_seq() + 1,
        Some(Ok(v)) => v,
        Some(Err(_)) => {
            return error(
                &ApiError::new(
                    ErrorKind::InvalidRequest,
                    "`from` must be a sequence number",
                )
                .with_param("from"),
            )
        }
    };
    let super::events::Subscription { replay, mut live } = match log.subscribe(from) {
        Ok(s) => s,
        Err(gone) => {
            let e = ApiError::new(ErrorKind::InvalidRequest, format!("events before {} are no longer retained: take /kv/snapshot and replay from its seq + 1", gone.oldest));
            let mut r = error(&e);
            *r.status_mut() = StatusCode::GONE;
            return r;
        }
    };
    drop(log);
    let line = |b: &kvgate_protocol::kv_events::KvEventBatch| {
        let mut s = serde_json::to_string(b).unwrap_or_default();
        s.push('\n');
        s
    };
    if !follow {
        let body: String = replay.iter().map(|b| line(b)).collect();
        return with_type(Response::new(full(body)), "application/x-ndjson");
    }
    let line = move |b: &kvgate_protocol::kv_events::KvEventBatch| -> Chunk {
        Ok(Frame::data(Bytes::from(line(b))))
    };
    let (tx, rx) = mpsc::channel::<Chunk>(64);
    tokio::spawn(async move {
        let mut next = from;
        for batch in replay {
            next = batch.seq + 1;
            if tx.send(line(&batch)).await.is_err() {
                return;
            }
        }
        loop {
            match live.recv().await {
                Ok(batch) if batch.seq >= next => {
                    next = batch.seq + 1;
                    if tx.send(line(&batch)).await.is_err() {
                        return;
                    }
                }
                Ok(_) => {}
                // Lagged or closed: end the stream; the subscriber resynchronises.
                Err(_) => return,
            }
        }
    });
    with_type(Response::new(ChannelBody(rx)), "application/x-ndjson")
}

/// vLLM's `/tokenize`: a text `prompt` (with `add_special_tokens`), or chat `messages`
/// rendered with the chat template as `/v1/chat/completions` renders them.
async fn tokenize(ctx: &Arc<Context>, req: Request<Incoming>) -> Reply {
    #[derive(serde::Deserialize)]
    struct TokenizeRequest {
        #[serde(default)]
        prompt: Option<String>,
        #[serde(default)]
        messages: Option<Vec<ChatMessage>>,
        #[serde(default = "yes")]
        add_special_tokens: bool,
    }
    fn yes() -> bool {
        true
    }
    let body = match read_body(req, ctx.body_timeout).await {
        Ok(b) => b,
        Err(e) => return error(&e),
    };
    let tokens = apart(ctx, move |ctx| {
        let r: TokenizeRequest = kvgate_protocol::openai::deserialize(&body)?;
        let tokenizer = &ctx.model.prompt.tokenizer;
        let prompt = match (r.prompt, r.messages) {
            (Some(prompt), None) => prompt,
            (None, Some(messages)) => {
                let chat = GenerationRequest {
                    messages: Some(messages),
                    ..Default::default()
                };
                let (ids, _) =
                    ctx.model
                        .prompt
                        .prompt_ids(Endpoint::Chat, &chat, ctx.max_model_len)?;
                return Ok(ids);
            }
            _ => {
                return Err(ApiError::new(
                    ErrorKind::InvalidRequest,
                    "give either `prompt` (text) or `messages` (a chat)".to_string(),
                )
                .with_param("prompt"))
            }
        };
        let most = ctx.max_model_len.saturating_mul(tokenizer.max_token_bytes());
        if prompt.len() > most {
            return Err(ApiError::new(
                ErrorKind::InvalidRequest,
                format!(
                    "the prompt has {} bytes, more than a context of {} tokens can hold ({most} bytes)",
                    prompt.len(),
                    ctx.max_model_len
                ),
            )
            .with_param("prompt"));
        }
        tokenizer
            .encode(&prompt, r.add_special_tokens)
            .map_err(|e| ApiError::new(ErrorKind::Internal, e.to_string()))
    })
    .await;
    match tokens {
        Ok(tokens) => json(
            200,
            &serde_json::json!({ "count": tokens.len(), "max_model_len": ctx.max_model_len, "tokens": tokens }),
        ),
        Err(e) => error(&e),
    }
}

async fn detokenize(ctx: &Arc<Context>, req: Request<Incoming>) -> Reply {
    #[derive(serde::Deserialize)]
    struct DetokenizeRequest {
        tokens: Vec<u32>,
    }
    let body = match read_body(req, ctx.body_timeout).await {
        Ok(b) => b,
        Err(e) => return error(&e),
    };
    let prompt = apart(ctx, move |ctx| {
        let r: DetokenizeRequest = kvgate_protocol::openai::deserialize(&body)?;
        let tokenizer = &ctx.model.prompt.tokenizer;
        let vocab = tokenizer.vocab_size();
        if let Some(bad) = r.tokens.iter().find(|&&t| t >= vocab) {
            return Err(ApiError::new(
                ErrorKind::InvalidRequest,
                format!("token id {bad} is outside the vocabulary (size {vocab})"),
            )
            .with_param("tokens"));
        }
        tokenizer
            .decode(&r.tokens, false)
            .map_err(|e| ApiError::new(ErrorKind::Internal, e.to_string()))
    })
    .await;
    match prompt {
        Ok(prompt) => json(200, &serde_json::json!({ "prompt": prompt })),
        Err(e) => error(&e),
    }
}

fn json<T: serde::Serialize>(status: u16, value: &T) -> Reply {
    let mut r = Response::new(full(serde_json::to_vec(value).unwrap_or_default()));
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    with_type(r, "application/json")
}

fn error(e: &ApiError) -> Reply {
    let mut r = Response::new(full(e.to_json()));
    *r.status_mut() = StatusCode::from_u16(e.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    with_type(r, "application/json")
}

fn with_type(mut r: Reply, content_type: &'static str) -> Reply {
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static(content_type),
    );
    r
}
