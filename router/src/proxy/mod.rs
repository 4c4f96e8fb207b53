//! The client-facing listener: OpenAI routes, health, models and metrics.

mod answer_end;
mod body;
pub(crate) mod disagg;
mod forward;
mod gather;
pub mod header;
mod in_place;
pub mod request;
mod request_id;
pub mod respond;
mod this_thread;
mod upstream_wire;
mod write_buffered;

use crate::classes::Class;
use crate::config::PdPool;
use crate::gateway::{Gateway, Route, Snapshot};
use crate::tenants::{Lease, Refusal, Tenant, UNSET_MAX_TOKENS_CHARGE};
use async_trait::async_trait;
use body::BodyError;
use forward::{Forward, Outcome};
use http::Method;
use kvgate_protocol::openai::Endpoint;
use kvgate_protocol::openai::ModelList;
use kvgate_protocol::{ApiError, ErrorKind};
use pingora_core::apps::{
    HttpPersistentSettings, HttpServerApp, HttpServerOptions, ReusedHttpStream, ServerApp,
};
use pingora_core::protocols::http::ServerSession;
use pingora_core::protocols::Stream;
use pingora_core::server::ShutdownWatch;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::Instrument;

/// How long an over-limit request body is drained after its 413 before the connection closes.
const LINGER: std::time::Duration = std::time::Duration::from_secs(2);

pub struct ProxyApp {
    gateway: Arc<Gateway>,
    options: HttpServerOptions,
}

impl ProxyApp {
    pub fn new(gateway: Arc<Gateway>) -> Self {
        let mut options = HttpServerOptions::default();
        options.h2c = true;
        ProxyApp { gateway, options }
    }
}

#[async_trait]
impl HttpServerApp for ProxyApp {
    async fn process_new_http(
        self: &Arc<Self>,
        mut session: ServerSession,
        shutdown: &ShutdownWatch,
    ) -> Option<ReusedHttpStream> {
        let limits = self.gateway.snapshot().config.limits.clone();
        let max = self.gateway.connections.max(&limits);
        let pressed = || self.gateway.connections.pressed(max);
        if !header::read_header(&mut session, &limits, pressed).await {
            return None;
        }
        // Each write to the client, the answer's chunks and error bodies alike.
        session.set_write_timeout(Some(Duration::from_millis(limits.send_timeout_ms)));
        // Pingora has read what the client asked for (HTTP/1.0 and `Connection: close` end
        // the connection after the response); a stopping gateway keeps none.
        let keep = !*shutdown.borrow() && session.get_keepalive().is_some();
        session.set_keepalive(keep.then_some(header::KEEPALIVE_S));
        let request_id = request_id::of(&session);
        let span = tracing::info_span!("request", id = %request_id);
        let active = self.gateway.drain.enter();
        let outcome = self
            .handle(&mut session, &request_id)
            .instrument(span)
            .await;
        drop(active);
        if outcome == Outcome::Close {
            return None;
        }
        let mut settings = HttpPersistentSettings::for_session(&session);
        settings.set_user_context(Box::new(header::Reused));
        match session.finish().await {
            Ok(stream) => stream.map(|s| ReusedHttpStream::from_reusable_stream(s, settings)),
            Err(_) => None,
        }
    }

    fn server_options(&self) -> Option<&HttpServerOptions> {
        Some(&self.options)
    }
}

/// The listening service's app: [`ProxyApp`] behind a deadline for a connection's first bytes
/// (see [`header::first_bytes`]), each connection on the thread that serves it.
pub struct ProxyService {
    app: Arc<ProxyApp>,
    /// The proxy runtime's threads: with one, the accepting runtime is the serving one.
    threads: usize,
}

impl ProxyService {
    pub fn new(gateway: Arc<Gateway>, threads: usize) -> Self {
        ProxyService {
            app: Arc::new(ProxyApp::new(gateway)),
            threads,
        }
    }
}

#[async_trait]
impl ServerApp for ProxyService {
    async fn process_new(
        self: &Arc<Self>,
        stream: Stream,
        shutdown: &ShutdownWatch,
    ) -> Option<Stream> {
        let gateway = &self.app.gateway;
        // Read once: the snapshot (tokenizers and all) is not held for the connection's life.
        let (max, header_timeout_ms) = {
            let limits = &gateway.snapshot().config.limits;
            (gateway.connections.max(limits), limits.header_timeout_ms)
        };
        let Some(_open) = gateway.connections.enter(max) else {
            gateway.metrics.connections_refused.inc();
            header::refuse(stream).await;
            return None;
        };
        let mut stream = if self.threads > 1 {
            this_thread::to_this_thread(stream)
        } else {
            stream
        };
        let deadline = Duration::from_millis(header_timeout_ms);
        let pressed = || gateway.connections.pressed(max);
        if !header::first_bytes(&mut stream, deadline, pressed).await {
            return None;
        }
        self.app.process_new(stream, shutdown).await
    }

    async fn cleanup(&self) {
        ServerApp::cleanup(self.app.as_ref()).await;
    }
}

impl ProxyApp {
    async fn handle(&self, session: &mut ServerSession, request_id: &str) -> Outcome {
        let started = Instant::now();
        let method = session.req_header().method.clone();
        let path = session.req_header().uri.path().to_string();
        let gateway = &self.gateway;
        let sent = match (&method, path.as_str()) {
            (&Method::POST, "/v1/chat/completions") => {
                return self
                    .proxy(session, Endpoint::Chat, request_id, started)
                    .await;
            }
            (&Method::POST, "/v1/completions") => {
                return self
                    .proxy(session, Endpoint::Completions, request_id, started)
                    .await;
            }
            (&Method::GET, "/health") => {
                respond::send_json(session, 200, br#"{"status":"ok"}"#.to_vec(), &[]).await
            }
            (&Method::GET, "/v1/models") => {
                let list = ModelList::new(gateway.models());
                respond::send_json(
                    session,
                    200,
                    serde_json::to_vec(&list).unwrap_or_default(),
                    &[],
                )
                .await
            }
            (&Method::GET, "/metrics") => {
                crate::admin::refresh_gauges(gateway);
                respond::send(
                    session,
                    200,
                    "text/plain; version=0.0.4",
                    gateway.metrics.render(),
                    &[],
                )
                .await
            }
            (
                _,
                "/v1/chat/completions" | "/v1/completions" | "/health" | "/v1/models" | "/metrics",
            ) => {
                let e = ApiError::new(
                    ErrorKind::MethodNotAllowed,
                    format!("{method} is not allowed on {path}"),
                );
                respond::send_error(session, &e, request_id).await
            }
            _ => {
                let e = ApiError::new(ErrorKind::NotFound, format!("no route for {method} {path}"));
                respond::send_error(session, &e, request_id).await
            }
        };
        Outcome::of(sent)
    }

    async fn proxy(
        &self,
        session: &mut ServerSession,
        endpoint: Endpoint,
        request_id: &str,
        started: Instant,
    ) -> Outcome {
        let gateway = &self.gateway;
        let snapshot = gateway.snapshot();
        let route_label = endpoint.path();
        // Who is asking comes first: nothing of an unknown client's body is read.
        let tenant = match &snapshot.tenants {
            None => None,
            Some(tenants) => match tenants
                .authenticate(session.get_header("authorization").map(|v| v.as_bytes()))
            {
                Ok(t) => Some(t),
                Err(error) => {
                    gateway.metrics.unauthorized.inc();
                    session.set_keepalive(None);
                    self.reject(session, route_label, error, request_id).await;
                    return Outcome::Close;
                }
            },
        };
        let limits = &snapshot.config.limits;
        let body =
            match body::read_body(session, limits.max_body_bytes, limits.body_timeout_ms).await {
                Ok(body) => body,
                Err(BodyError::TooLarge(error)) => {
                    // The rest of the body is unread: the connection cannot be reused. Discard
                    // what the client still sends for a moment (a lingering close, as nginx does),
                    // so that it can read the 413 instead of a connection reset.
                    session.set_keepalive(None);
                    self.reject(session, route_label, error, request_id).await;
                    let _ = tokio::time::timeout(LINGER, session.drain_request_body()).await;
                    return Outcome::Close;
                }
                Err(BodyError::TooSlow(error)) => {
                    session.set_keepalive(None);
                    self.reject(session, route_label, error, request_id).await;
                    return Outcome::Close;
                }
                Err(BodyError::Client(reason)) => {
                    tracing::debug!(%reason, "client failed while sending the body");
                    return Outcome::Close;
                }
            };
        let session_id = session
            .get_header("x-session-id")
            .map(|v| v.as_bytes().to_vec());
        let routed = match self.parse(endpoint, &body, &snapshot, session_id).await {
            Ok(r) => r,
            Err(error) => return self.reject(session, route_label, error, request_id).await,
        };
        let mut routed = routed;
        let class = match &snapshot.classes {
            None => None,
            Some(classes) => {
                let header = session.get_header(classes.header()).map(|v| v.as_bytes());
                match classes.classify(header, tenant.as_deref()) {
                    Ok(class) => {
                        routed.features.weights = Some(class.weights.clone());
                        Some(class)
                    }
                    Err(error) => {
                        return self.reject(session, route_label, error, request_id).await
                    }
                }
            }
        };
        // Held until the answer ends: the tenant's request in flight.
        let lease = match &tenant {
            None => None,
            Some(t) => match self.admit_tenant(t, &routed) {
                Ok(lease) => Some(lease),
                Err(refusal) => {
                    let status = refusal.error.status().to_string();
                    gateway
                        .metrics
                        .requests
                        .with_label_values(&[route_label, &status, "none"])
                        .inc();
                    let sent = respond::send_error_after(
                        session,
                        &refusal.error,
                        request_id,
                        refusal.retry_after,
                    )
                    .await;
                    return Outcome::of(sent);
                }
            },
        };
        let pd_pool = snapshot
            .config
            .disaggregation
            .as_ref()
            .and_then(|d| d.pool(&routed.model));
        let admitted = tokio::select! {
            admitted = self.admit(&snapshot, &routed, class.as_ref(), pd_pool) => admitted,
            _ = gateway.drain.grace_over() => Err(shutting_down()),
        };
        let route = match admitted {
            Ok(route) => route,
            Err(error) => return self.reject(session, route_label, error, request_id).await,
        };
        let body = match pd_pool {
            None => body,
            Some(pool) => {
                let hand_over = disagg::HandOver {
                    gateway,
                    snapshot: &snapshot,
                    pool,
                    endpoint,
                    request_id,
                    features: &routed.features,
                };
                // Boxed, as a future of about 12 KB that only disaggregated pools await.
                let prefill = Box::pin(hand_over.prefill(body, &routed.model, class.as_ref()));
                match prefill.await {
                    Ok(body) => body,
                    Err(answer) => {
                        gateway
                            .metrics
                            .requests
                            .with_label_values(&[route_label, &answer.status.to_string(), "none"])
                            .inc();
                        let sent =
                            respond::send_json(session, answer.status, answer.body.to_vec(), &[])
                                .await;
                        return Outcome::of(sent);
                    }
                }
            }
        };
        let debug = snapshot.config.debug_headers
            && session
                .get_header("x-kvgate-debug")
                .is_some_and(|v| v.as_bytes() == b"1");
        let forward = Forward {
            gateway,
            snapshot: &snapshot,
            endpoint,
            body,
            features: &routed.features,
            request_id,
            started,
            debug,
            tenant_slot: lease.as_ref(),
        };
        forward.run(session, route).await
    }
}

impl ProxyApp {
    /// Admits and routes a request: among the decode replicas of its prefill/decode pool, if
    /// it has one (queued only where its SLA class queues).
    async fn admit(
        &self,
        snapshot: &Arc<Snapshot>,
        routed: &request::RoutedRequest,
        class: Option<&Arc<Class>>,
        pd_pool: Option<&PdPool>,
    ) -> Result<Route, ApiError> {
        let (model, features) = (&routed.model, &routed.features);
        let Some(pool) = pd_pool else {
            return self.gateway.admit(snapshot, model, features, class).await;
        };
        let decode = disagg::phase_class(class, "decode", &pool.decode, snapshot);
        match class {
            Some(_) => {
                let decode = Some(&decode);
                self.gateway.admit(snapshot, model, features, decode).await
            }
            None => self.gateway.route(snapshot, model, features, Some(&decode)),
        }
    }

    /// Counts a tenant's request against its limits: in flight, and its prompt plus its
    /// output limit against its tokens per minute.
    fn admit_tenant(
        &self,
        tenant: &Tenant,
        routed: &request::RoutedRequest,
    ) -> Result<Lease, Refusal> {
        let output = routed
            .max_output_tokens
            .map_or(UNSET_MAX_TOKENS_CHARGE, u64::from);
        let tokens = routed.features.prompt_tokens.saturating_add(output);
        let m = &self.gateway.metrics;
        match tenant.admit(tokens, Instant::now()) {
            Ok(lease) => {
                m.tenant_requests.with_label_values(&[&tenant.name]).inc();
                m.tenant_tokens
                    .with_label_values(&[&tenant.name])
                    .inc_by(tokens);
                Ok(lease)
            }
            Err(refusal) => {
                m.tenant_refused
                    .with_label_values(&[&tenant.name, refusal.limit.label()])
                    .inc();
                Err(refusal)
            }
        }
    }
}

/// Token mode: at most this much prompt text found in no tokenization cache is tokenized in
/// place (a new user turn behind a cached system prompt), each chat message counted as
/// [`kvgate_prompt::RENDER_BYTES_PER_MESSAGE`] more; a prompt needing more goes to a blocking
/// thread, since tokenizing a cold long prompt, or rendering thousands of turns, takes
/// milliseconds.
const TOKENIZE_IN_PLACE_BYTES: usize = 2 << 10;

impl ProxyApp {
    async fn parse(
        &self,
        endpoint: Endpoint,
        body: &bytes::Bytes,
        snapshot: &Arc<Snapshot>,
        session_id: Option<Vec<u8>>,
    ) -> Result<request::RoutedRequest, ApiError> {
        let now_us = self.gateway.now_us();
        let tie_draw = self.gateway.tie_draw();
        let parse = move |snap: &Snapshot, body: &[u8], budget: usize| {
            let cx = request::ParseContext {
                policy: &snap.config.policy,
                tokenizers: &snap.tokenizers,
                session_header: session_id.as_deref(),
                now_us,
                tie_draw,
            };
            request::parse_within(endpoint, body, &cx, budget)
        };
        if in_place::parse_here(body) {
            if let Some(routed) = parse(snapshot, body, TOKENIZE_IN_PLACE_BYTES)? {
                return Ok(routed);
            }
        }
        let stopping = || ApiError::new(ErrorKind::Unavailable, "the gateway is stopping");
        let _slot = self
            .gateway
            .parse_slots
            .acquire()
            .await
            .map_err(|_| stopping())?;
        let (snap, body) = (Arc::clone(snapshot), body.clone());
        tokio::task::spawn_blocking(move || parse(&snap, &body, usize::MAX))
            .await
            .map_err(|_| stopping())??
            .ok_or_else(|| ApiError::new(ErrorKind::Internal, "unbounded tokenization stopped"))
    }

    /// Answers a request the gateway turns down itself.
    async fn reject(
        &self,
        session: &mut ServerSession,
        route: &str,
        error: ApiError,
        request_id: &str,
    ) -> Outcome {
        let status = error.status().to_string();
        self.gateway
            .metrics
            .requests
            .with_label_values(&[route, &status, "none"])
            .inc();
        Outcome::of(respond::send_error(session, &error, request_id).await)
    }
}

/// The answer to a request still unanswered when a stop's grace period ends.
pub fn shutting_down() -> ApiError {
    ApiError::new(ErrorKind::Unavailable, "the gateway is shutting down")
}
