//! The admin listener: replica state with last scores, decision explanations, reload, metrics.
//! With `admin_token_file`, every `/admin/` route asks for its bearer token; `/health` and
//! `/metrics` stay open (they carry no secrets), and agents post reports with their own token.

use crate::gateway::Gateway;
use crate::peers::PEER_PATH;
use crate::proxy::disagg::phase_class;
use crate::proxy::request;
use crate::proxy::respond;
use crate::replica::Replica;
use async_trait::async_trait;
use bytes::BytesMut;
use http::Method;
use kvgate_policies::{ReplicaState, ReportAges};
use kvgate_protocol::openai::Endpoint;
use kvgate_protocol::telemetry::{token_matches, REPORT_PATH};
use kvgate_protocol::{ApiError, ErrorKind};
use pingora_core::apps::{HttpPersistentSettings, HttpServerApp, ReusedHttpStream};
use pingora_core::protocols::http::ServerSession;
use pingora_core::server::ShutdownWatch;
use std::sync::Arc;

/// Largest body the admin API reads (an explain request).
const ADMIN_BODY_LIMIT: usize = 32 << 20;

pub struct AdminApp {
    gateway: Arc<Gateway>,
}

impl AdminApp {
    pub fn new(gateway: Arc<Gateway>) -> Self {
        AdminApp { gateway }
    }
}

/// Sets the per-replica gauges from live state, just before a scrape.
pub fn refresh_gauges(gateway: &Gateway) {
    let snap = gateway.snapshot();
    let now = gateway.now_ms();
    let fleet = gateway.fleet();
    let ages = fleet.report_ages();
    let m = &gateway.metrics;
    m.client_connections
        .set(i64::try_from(gateway.connections.open()).unwrap_or(i64::MAX));
    for replica in &snap.replicas {
        let Some(r) = fleet.replica(replica.slot) else {
            continue;
        };
        let name = replica.name.as_str();
        m.in_flight
            .with_label_values(&[name])
            .set(i64::from(r.in_flight));
        m.prefill_backlog
            .with_label_values(&[name])
            .set(i64::try_from(r.prefill_backlog()).unwrap_or(i64::MAX));
        m.healthy
            .with_label_values(&[name])
            .set(i64::from(r.is_routable(ages, now)));
        if let Some(last) = &r.last_decision {
            m.last_score
                .with_label_values(&[name, "total"])
                .set(last.total);
            for (signal, value) in last.signals.iter() {
                m.last_score
                    .with_label_values(&[name, signal.name()])
                    .set(value);
            }
        }
    }
}

#[async_trait]
impl HttpServerApp for AdminApp {
    async fn process_new_http(
        self: &Arc<Self>,
        mut session: ServerSession,
        _shutdown: &ShutdownWatch,
    ) -> Option<ReusedHttpStream> {
        let limits = self.gateway.snapshot().config.limits.clone();
        // Admin connections are not counted against the client bound.
        if !crate::proxy::header::read_header(&mut session, &limits, || false).await {
            return None;
        }
        let method = session.req_header().method.clone();
        let path = session.req_header().uri.path().to_string();
        let gateway = &self.gateway;
        if path.starts_with("/admin/") {
            if let Err(e) = authorize(gateway, &session) {
                // The body, if any, is left unread: the connection cannot be reused.
                session.set_keepalive(None);
                respond::send_json(&mut session, e.status(), e.to_json(), &[]).await;
                return None;
            }
        }
        let (status, body): (u16, Vec<u8>) = match (&method, path.as_str()) {
            (&Method::GET, "/health") => (200, br#"{"status":"ok"}"#.to_vec()),
            (&Method::GET, "/metrics") => {
                refresh_gauges(gateway);
                let ok = respond::send(
                    &mut session,
                    200,
                    "text/plain; version=0.0.4",
                    gateway.metrics.render(),
                    &[],
                )
                .await;
                return finish(session, ok).await;
            }
            (&Method::GET, "/admin/replicas") => {
                let snap = gateway.snapshot();
                let replicas: Vec<serde_json::Value> = snap
                    .replicas
                    .iter()
                    .map(|r| replica_status(gateway, r))
                    .collect();
                (200, json(&serde_json::json!({ "replicas": replicas })))
            }
            (&Method::GET, "/admin/config") => (200, json(&redacted(&gateway.snapshot().config))),
            (&Method::POST, "/admin/reload") => match reload_apart(gateway).await {
                Ok(()) => (200, br#"{"status":"reloaded"}"#.to_vec()),
                Err(errors) => {
                    let errors: Vec<String> = errors.iter().map(ToString::to_string).collect();
                    tracing::error!(?errors, "reload rejected; the running config is kept");
                    (
                        400,
                        json(&serde_json::json!({ "status": "rejected", "errors": errors })),
                    )
                }
            },
            (&Method::POST, route @ (REPORT_PATH | PEER_PATH)) => {
                let auth = session
                    .req_header()
                    .headers
                    .get(http::header::AUTHORIZATION)
                    .map(|v| v.as_bytes().to_vec());
                let body = read_all(&mut session, &limits).await?;
                if route == REPORT_PATH {
                    crate::agents::take_report(gateway, auth.as_deref(), &body)
                } else {
                    crate::peers::take_push(gateway, auth.as_deref(), &body)
                }
            }
            (&Method::POST, "/admin/explain") => match read_all(&mut session, &limits).await {
                Some(body) => explain(gateway, &body),
                None => return None,
            },
            _ => {
                let e = ApiError::new(
                    ErrorKind::NotFound,
                    format!("no admin route for {method} {path}"),
                );
                (404, e.to_json())
            }
        };
        let ok = respond::send_json(&mut session, status, body, &[]).await;
        finish(session, ok).await
    }
}

/// Checks the admin token, when there is one.
fn authorize(gateway: &Gateway, session: &ServerSession) -> Result<(), ApiError> {
    let Some(token) = gateway.tokens().admin.clone() else {
        return Ok(());
    };
    let presented = session
        .get_header(http::header::AUTHORIZATION)
        .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "));
    match presented {
        Some(p) if token_matches(p, token.as_bytes()) => Ok(()),
        _ => Err(ApiError::new(
            ErrorKind::Unauthorized,
            "the admin API needs its token: `Authorization: Bearer TOKEN` (admin_token_file)",
        )),
    }
}

/// The config as `/admin/config` shows it: every key hash replaced, so that nothing that
/// admits a request leaves the gateway.
fn redacted(config: &crate::config::GatewayConfig) -> serde_json::Value {
    let mut v = serde_json::to_value(config).unwrap_or_default();
    if let Some(tenants) = v.get_mut("tenants").and_then(|t| t.as_object_mut()) {
        for tenant in tenants.values_mut() {
            if let Some(keys) = tenant.get_mut("api_keys").and_then(|k| k.as_array_mut()) {
                for key in keys {
                    *key = "<redacted>".into();
                }
            }
        }
    }
    v
}

/// Reloads on a blocking thread: reading and checking a config (tokenizers included) must not
/// hold up the admin listener's other requests, agents' reports among them.
async fn reload_apart(gateway: &Arc<Gateway>) -> Result<(), Vec<crate::ConfigError>> {
    let gateway = Arc::clone(gateway);
    tokio::task::spawn_blocking(move || gateway.reload())
        .await
        .unwrap_or_else(|e| {
            Err(vec![crate::ConfigError {
                path: ".".into(),
                line: None,
                message: format!("the reload failed: {e}"),
            }])
        })
}

/// Explains how a chat or completion request body would be routed (chat when it has
/// `messages`), without sending it.
fn explain(gateway: &Gateway, body: &[u8]) -> (u16, Vec<u8>) {
    let is_chat = serde_json::from_slice::<serde_json::Value>(body)
        .is_ok_and(|v| v.get("messages").is_some());
    let endpoint = if is_chat {
        Endpoint::Chat
    } else {
        Endpoint::Completions
    };
    let snap = gateway.snapshot();
    let cx = request::ParseContext {
        policy: &snap.config.policy,
        tokenizers: &snap.tokenizers,
        session_header: None,
        now_us: gateway.now_us(),
        // The first in ring order of a tie (a routed request draws one of them: `tied`).
        tie_draw: 0,
    };
    let result = request::parse(endpoint, body, &cx).and_then(|mut routed| {
        // As a request of the default class would be routed.
        let class = match &snap.classes {
            Some(classes) => Some(classes.classify(None, None)?),
            None => None,
        };
        if let Some(c) = &class {
            routed.features.weights = Some(c.weights.clone());
        }
        let pool = snap.config.disaggregation.as_ref();
        let Some(pool) = pool.and_then(|d| d.pool(&routed.model)) else {
            return gateway.explain(&routed.model, &routed.features, class.as_deref());
        };
        // A prefill/decode pool: each leg's ranking, within its phase.
        let phase = |name: &str, labels| {
            let narrowed = phase_class(class.as_ref(), name, labels, &snap);
            gateway.explain(&routed.model, &routed.features, Some(&narrowed))
        };
        let wants_prefill = routed.features.prompt_tokens >= pool.min_prompt_tokens;
        let prefill = match wants_prefill {
            true => Some(phase("prefill", &pool.prefill)?),
            false => None,
        };
        let decode = phase("decode", &pool.decode)?;
        Ok(serde_json::json!({ "model": routed.model, "prefill": prefill, "decode": decode }))
    });
    match result {
        Ok(v) => (200, json(&v)),
        Err(e) => (e.status(), e.to_json()),
    }
}

fn json<T: serde::Serialize>(value: &T) -> Vec<u8> {
    serde_json::to_vec_pretty(value).unwrap_or_default()
}

/// The whole body, within [`ADMIN_BODY_LIMIT`] and the body deadline; `None` (the connection
/// closes) otherwise.
async fn read_all(session: &mut ServerSession, limits: &crate::config::Limits) -> Option<Vec<u8>> {
    let read = async {
        let mut body = BytesMut::new();
        while let Some(chunk) = session.read_request_body().await.ok()? {
            if body.len() + chunk.len() > ADMIN_BODY_LIMIT {
                return None;
            }
            body.extend_from_slice(&chunk);
        }
        Some(body.to_vec())
    };
    let deadline = std::time::Duration::from_millis(limits.body_timeout_ms);
    tokio::time::timeout(deadline, read).await.ok()?
}

async fn finish(session: ServerSession, ok: bool) -> Option<ReusedHttpStream> {
    if !ok {
        return None;
    }
    let mut settings = HttpPersistentSettings::for_session(&session);
    settings.set_user_context(Box::new(crate::proxy::header::Reused));
    let stream = session.finish().await.ok()??;
    Some(ReusedHttpStream::from_reusable_stream(stream, settings))
}

/// A replica's live state for the admin API.
fn replica_status(gateway: &Gateway, replica: &Replica) -> serde_json::Value {
    let fleet = gateway.fleet();
    let Some(r) = fleet.replica(replica.slot) else {
        return serde_json::json!({ "id": replica.name, "url": replica.config.url });
    };
    let now = gateway.now_ms();
    let ages = fleet.report_ages();
    status_json(replica, r, ages, now)
}

fn status_json(
    replica: &Replica,
    r: &ReplicaState,
    ages: Option<ReportAges>,
    now: u64,
) -> serde_json::Value {
    let agent = r.agent.as_ref().map(|a| {
        serde_json::json!({
            "age_ms": now.saturating_sub(a.received_ms),
            "instance": a.instance,
            "seq": a.seq,
            "missed_reports": a.missed,
            "healthy": a.healthy,
            "running": a.load.running,
            "waiting": a.load.waiting,
            "kv_blocks_total": a.load.kv_blocks_total,
            "kv_usage": a.load.kv_usage(),
            "adapters": a.load.adapters,
            "gpus": a.gpus,
            "gateways": a.gateways,
        })
    });
    serde_json::json!({
        "id": replica.name,
        "url": replica.config.url,
        "healthy": r.healthy,
        "ejected": r.is_ejected(now),
        "available": r.is_routable(ages, now),
        "freshness": r.freshness(ages, now),
        "agent": agent,
        "in_flight": r.in_flight,
        "prefill_backlog": r.prefill_backlog(),
        "consecutive_failures": r.consecutive_failures,
        "ejections_in_a_row": r.ejections,
        "models": r.models(),
        "labels": replica.config.labels,
        "last_scores": r.last_decision,
    })
}
