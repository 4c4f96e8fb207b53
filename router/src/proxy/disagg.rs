//! Prefill/decode disaggregation at the gateway. A request on a model with a pool under
//! `disaggregation:` is admitted to a decode replica (scored as any request, among the
//! replicas with the pool's decode labels); if its prompt is long enough, a prefill replica
//! (among those with the prefill labels) gets the prompt first, by the pool's flow, and the
//! decode leg's body carries what that replica needs to take the prompt over. The decode leg
//! is then forwarded like any request, so retries, streaming and accounting are the usual.

use crate::classes::Class;
use crate::config::{PdFlow, PdPool};
use crate::gateway::{Gateway, Route, Snapshot};
use crate::replica::Replica;
use bytes::Bytes;
use kvgate_policies::RequestFeatures;
use kvgate_protocol::openai::Endpoint;
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// `class` (or any request, without one) narrowed to replicas with `labels`.
pub fn phase_class(
    class: Option<&Arc<Class>>,
    phase: &str,
    labels: &BTreeMap<String, String>,
    snap: &Snapshot,
) -> Arc<Class> {
    let mut narrowed = class.map_or_else(
        || Class {
            name: phase.into(),
            priority: 0,
            sheddable: false,
            pool: BTreeMap::new(),
            weights: snap.config.policy.weights.clone(),
            max_queue: 0,
            queue_timeout: Duration::ZERO,
        },
        |c| (**c).clone(),
    );
    narrowed
        .pool
        .extend(labels.iter().map(|(k, v)| (k.clone(), v.clone())));
    Arc::new(narrowed)
}

/// One request's hand-over, from its prefill leg to its decode leg.
pub struct HandOver<'a> {
    pub gateway: &'a Arc<Gateway>,
    pub snapshot: &'a Arc<Snapshot>,
    pub pool: &'a PdPool,
    pub endpoint: Endpoint,
    pub request_id: &'a str,
    pub features: &'a RequestFeatures,
}

/// Fields only the gateway sets in a pool: a client's are dropped, so that no client can point
/// a decode replica at an address of its choosing.
const HAND_OVER_FIELDS: [&str; 4] = [
    "kv_transfer_params",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
];

impl HandOver<'_> {
    /// The decode leg's body: after a prefill leg where the prompt is long enough, else the
    /// request's own (the decode replica serves it whole); hand-over fields a client sent are
    /// dropped either way. `class` is the request's.
    pub async fn prefill(
        &self,
        body: Bytes,
        model: &str,
        class: Option<&Arc<Class>>,
    ) -> Result<Bytes, Answer> {
        // Not an object: the decode replica refuses it as it would anywhere.
        let Ok(Value::Object(mut request)) = serde_json::from_slice::<Value>(&body) else {
            return Ok(body);
        };
        let sent = request.len();
        HAND_OVER_FIELDS.iter().for_each(|f| {
            request.remove(*f);
        });
        let body = match request.len() == sent {
            true => body,
            false => to_bytes(&request),
        };
        if self.features.prompt_tokens < self.pool.min_prompt_tokens {
            self.count("decode_only");
            return Ok(body);
        }
        let prefill = phase_class(class, "prefill", &self.pool.prefill, self.snapshot);
        let route = match self
            .gateway
            .route(self.snapshot, model, self.features, Some(&prefill))
        {
            Ok(route) => route,
            Err(e) => {
                // No prefill replica can take it: the decode replica computes the prompt.
                self.fell_back(&e.message);
                return Ok(body);
            }
        };
        match self.pool.flow {
            PdFlow::Vllm => self.vllm(request, body, route).await,
            PdFlow::Sglang => Ok(self.sglang(request, route)),
        }
    }

    /// vLLM's flow: the prefill leg whole, with one output token and a request for remote
    /// decode, on each ranked replica in turn; its `kv_transfer_params` go to the decode leg.
    async fn vllm(
        &self,
        request: Map<String, Value>,
        body: Bytes,
        route: Route,
    ) -> Result<Bytes, Answer> {
        let mut leg = request.clone();
        leg.insert("max_tokens".into(), json!(1));
        if leg.contains_key("max_completion_tokens") {
            leg.insert("max_completion_tokens".into(), json!(1));
        }
        leg.insert("stream".into(), json!(false));
        leg.remove("stream_options");
        leg.insert("n".into(), json!(1));
        leg.insert(
            "kv_transfer_params".into(),
            json!({"do_remote_decode": true, "do_remote_prefill": false}),
        );
        let leg = to_bytes(&leg);
        let attempts = self.snapshot.config.retries.attempts.max(1) as usize;
        let mut first = Some(route.first);
        let mut last = String::from("no prefill replica");
        for (replica, candidate) in route.ranked.iter().take(attempts) {
            let _in_flight = match first.take() {
                Some(guard) => guard,
                None => self.gateway.resend(candidate, self.features),
            };
            match self.prefill_leg(replica, leg.clone()).await {
                Ok(params) => {
                    self.count("prefill_decode");
                    let mut decode = request;
                    decode.insert("kv_transfer_params".into(), params);
                    return Ok(to_bytes(&decode));
                }
                Err(LegError::Refused(answer)) => return Err(answer),
                Err(LegError::Failed(why)) => {
                    tracing::info!(replica = %replica.name, %why, "prefill leg failed: trying the next prefill replica");
                    last = why;
                }
            }
        }
        self.fell_back(&last);
        Ok(body)
    }

    async fn prefill_leg(&self, replica: &Replica, leg: Bytes) -> Result<Value, LegError> {
        let (gateway, snapshot) = (self.gateway, self.snapshot);
        let path = self.endpoint.path();
        let answer = send_leg(gateway, snapshot, replica, path, self.request_id, leg).await;
        let failed = |kind: &str, why: String| {
            self.gateway
                .metrics
                .upstream_errors
                .with_label_values(&[&replica.name, kind])
                .inc();
            let _ = self
                .gateway
                .replica_failed(replica, &self.snapshot.config.health);
            LegError::Failed(why)
        };
        let (status, body) = match answer {
            Ok(answer) => answer,
            Err(e) => return Err(failed("prefill", e)),
        };
        match status {
            200 => {}
            // Busy, not failing: the next replica may take it.
            429 => {
                return Err(LegError::Failed(format!(
                    "replica `{}` answered 429",
                    replica.name
                )))
            }
            500.. => {
                let why = format!("replica `{}` answered {status}", replica.name);
                return Err(failed("prefill_status", why));
            }
            _ => return Err(LegError::Refused(Answer { status, body })),
        }
        self.gateway.replica_succeeded(replica);
        let params = serde_json::from_slice::<Value>(&body)
            .ok()
            .and_then(|v| v.get("kv_transfer_params").cloned())
            .filter(|p| !p.is_null());
        // An engine that returns none computed the prompt for nothing: the decode replica
        // computes it again rather than fail the request.
        Ok(params.unwrap_or_else(|| json!({"do_remote_prefill": false})))
    }

    /// SGLang's flow: the same request to the top prefill replica (answer discarded) and,
    /// from the caller, to the decode replica, both with the prefill replica's bootstrap
    /// address and a fresh room.
    fn sglang(&self, mut request: Map<String, Value>, route: Route) -> Bytes {
        let Some((replica, _)) = route.ranked.first() else {
            return to_bytes(&request);
        };
        let port = replica
            .config
            .labels
            .get("bootstrap_port")
            .and_then(|p| p.parse::<u16>().ok())
            .unwrap_or(self.pool.bootstrap_port);
        request.insert("bootstrap_host".into(), json!(replica.upstream.host));
        request.insert("bootstrap_port".into(), json!(port));
        request.insert("bootstrap_room".into(), json!(bootstrap_room()));
        self.count("prefill_decode");
        let body = to_bytes(&request);
        let (gateway, snapshot) = (Arc::clone(self.gateway), Arc::clone(self.snapshot));
        let (replica, path) = (Arc::clone(replica), self.endpoint.path());
        let (leg, request_id) = (body.clone(), self.request_id.to_string());
        let in_flight = route.first;
        tokio::spawn(async move {
            let answer = send_leg(&gateway, &snapshot, &replica, path, &request_id, leg).await;
            drop(in_flight);
            if let Err(e) = answer {
                tracing::warn!(replica = %replica.name, error = %e, "sglang prefill leg failed");
                let _ = gateway.replica_failed(&replica, &snapshot.config.health);
            }
        });
        body
    }

    fn fell_back(&self, why: &str) {
        tracing::warn!(%why, "no prefill replica took the prompt: the decode replica computes it");
        self.count("fallback");
    }

    pub fn count(&self, path: &str) {
        let flow = match self.pool.flow {
            PdFlow::Vllm => "vllm",
            PdFlow::Sglang => "sglang",
        };
        self.gateway
            .metrics
            .pd_requests
            .with_label_values(&[flow, path])
            .inc();
    }
}

/// A prefill leg to `replica`, answered whole within the first-byte timeout.
async fn send_leg(
    gateway: &Gateway,
    snapshot: &Snapshot,
    replica: &Replica,
    path: &str,
    request_id: &str,
    leg: Bytes,
) -> Result<(u16, Bytes), String> {
    let timeout = Duration::from_millis(snapshot.config.timeouts.first_byte_ms);
    let headers = [
        ("content-type", "application/json"),
        ("x-request-id", request_id),
    ];
    let connector = gateway.connector();
    crate::client::call(
        connector,
        &replica.upstream,
        "POST",
        path,
        &headers,
        Some(leg),
        timeout,
    )
    .await
}

fn to_bytes(request: &Map<String, Value>) -> Bytes {
    Bytes::from(serde_json::to_vec(request).unwrap_or_default())
}

/// A prefill replica's refusal, passed on to the client as it came.
pub struct Answer {
    pub status: u16,
    pub body: Bytes,
}

enum LegError {
    Refused(Answer),
    Failed(String),
}

/// SGLang's room: a non-negative 63-bit integer naming the hand-over, unique per request.
fn bootstrap_room() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let seed = [
        nanos,
        NEXT.fetch_add(1, Ordering::Relaxed),
        u64::from(std::process::id()),
    ];
    let bytes: Vec<u8> = seed.iter().flat_map(|x| x.to_le_bytes()).collect();
    xxhash_rust::xxh3::xxh3_64(&bytes) >> 1
}
