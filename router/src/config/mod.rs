//! The gateway's YAML configuration: types, defaults and validation. Loading lives in
//! [`load`], the one place that knows the YAML library.

mod disaggregation;
mod load;
mod validate;

pub use disaggregation::{DisaggregationConfig, PdFlow, PdPool};
pub use load::{
    load_file, load_file_warning, load_policy_file, parse_policy_str, parse_str, preset,
    preset_names, ConfigError, Loaded,
};
pub use validate::{resolve_url, Upstream};

use kvgate_policies::PolicyConfig;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewayConfig {
    /// Client-facing listener(s): one address or a list.
    pub listen: Listen,
    /// Admin API listener (replicas, explain, reload, metrics). Off when absent.
    #[serde(default)]
    pub admin_listen: Option<String>,
    /// File holding the admin API's bearer token, asked of every `/admin/` route (read at load
    /// and at each reload). Required when `admin_listen` is not a loopback address.
    #[serde(default)]
    pub admin_token_file: Option<std::path::PathBuf>,
    /// Worker threads of the proxy runtime.
    #[serde(default = "defaults::threads")]
    pub threads: usize,
    /// On SIGTERM or a graceful upgrade, how long requests in flight may take to finish
    /// (streams still running then end with an error event). Read at start.
    #[serde(default = "defaults::shutdown_grace_ms")]
    pub shutdown_grace_ms: u64,
    pub replicas: Vec<ReplicaConfig>,
    #[serde(default)]
    pub limits: Limits,
    #[serde(default)]
    pub timeouts: Timeouts,
    #[serde(default)]
    pub retries: Retries,
    #[serde(default)]
    pub health: HealthConfig,
    #[serde(default)]
    pub policy: PolicyConfig,
    /// Honour `x-kvgate-debug: 1` with `x-kvgate-replica` and `x-kvgate-route` headers.
    #[serde(default = "defaults::yes")]
    pub debug_headers: bool,
    /// Telemetry from agents (`POST /agent/report` on the admin listener). Off when absent.
    #[serde(default)]
    pub agents: Option<AgentsConfig>,
    /// Other gateway replicas in front of the same fleet, told this gateway's decisions so that
    /// they agree on where prefixes and sessions live. Off when absent.
    #[serde(default)]
    pub peers: Option<PeersConfig>,
    /// Token mode: models whose prompts the gateway tokenizes and hashes as their workers do,
    /// so that the workers' KV events locate each prompt's blocks exactly. Other models are
    /// routed in text mode.
    #[serde(default)]
    pub tokenizers: Vec<TokenizerConfig>,
    /// SLA classes: admission queues, priorities, shedding, pools and weights per class. Off
    /// when absent (every request is routed at once).
    #[serde(default)]
    pub sla: Option<SlaConfig>,
    /// HTTPS on the client listeners (and the admin one): certificate and key files, read at
    /// start and at each reload. Off when absent.
    #[serde(default)]
    pub tls: Option<TlsConfig>,
    /// Trust for `https://` replicas: a CA bundle (PEM) instead of the system's roots. Read at
    /// start.
    #[serde(default)]
    pub upstream_ca_file: Option<std::path::PathBuf>,
    /// Who may send requests: each tenant's API keys (as hashes), class and limits. When set,
    /// every request needs a key of one of them (401 otherwise).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tenants: BTreeMap<String, TenantConfig>,
    /// Prefill/decode disaggregation: replicas pooled by phase, and how a prompt is handed
    /// from one to the other. Off when absent (every replica serves requests whole).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disaggregation: Option<DisaggregationConfig>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// The certificate chain, PEM.
    pub cert_file: std::path::PathBuf,
    /// Its private key, PEM (PKCS#8, PKCS#1 or SEC1).
    pub key_file: std::path::PathBuf,
    /// The admin listener serves HTTPS too (agents then report with `https://` URLs).
    #[serde(default = "defaults::yes")]
    pub admin: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantConfig {
    /// SHA-256 hashes of the tenant's keys (`sha256:` and 64 hex digits, as `kvgate hash-key`
    /// prints them); requests send the key itself (`Authorization: Bearer KEY`).
    pub api_keys: Vec<String>,
    /// The SLA class of the tenant's requests (default: `sla.default_class`).
    #[serde(default)]
    pub class: Option<String>,
    /// Other classes its requests may ask for with the class header (403 for any else).
    #[serde(default)]
    pub allowed_classes: Vec<String>,
    /// Requests in flight at once; more get 429 with `Retry-After`.
    #[serde(default)]
    pub max_concurrent: Option<u32>,
    /// Tokens admitted per minute, each request charged its prompt plus its `max_tokens`
    /// (1,024 when unset); more get 429 with `Retry-After`.
    #[serde(default)]
    pub tokens_per_minute: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlaConfig {
    /// The request header that names a request's class.
    #[serde(default = "defaults::class_header")]
    pub header: String,
    /// The class of requests that name none (by header or API key).
    pub default_class: String,
    pub classes: BTreeMap<String, ClassConfig>,
    /// Honour the class header from any client. Otherwise only a tenant's requests may name a
    /// class, one of its `allowed_classes` (403 for others).
    #[serde(default)]
    pub trust_class_header: bool,
    /// Refused with a pointer to `tenants`: keys are no longer kept in clear.
    #[serde(default, skip_serializing)]
    pub api_keys: Option<serde_json::Value>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClassConfig {
    /// Higher is served first when requests queue.
    #[serde(default)]
    pub priority: u32,
    /// When the fleet has no room, refuse at once (429 with `Retry-After`) instead of queueing.
    #[serde(default)]
    pub sheddable: bool,
    /// Only replicas whose labels include all of these serve the class.
    #[serde(default)]
    pub pool: BTreeMap<String, String>,
    /// A policy preset whose weights the class uses ...
    #[serde(default)]
    pub preset: Option<String>,
    /// ... and weights set here over them (key by key; the rest from `policy`).
    #[serde(default)]
    pub weights: BTreeMap<String, f64>,
    /// Requests of the class waiting at most; more get 429 with `Retry-After`.
    #[serde(default = "defaults::max_queue")]
    pub max_queue: usize,
    /// A queued request that waits this long gets 503 with `Retry-After`.
    #[serde(default = "defaults::queue_timeout_ms")]
    pub queue_timeout_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenizerConfig {
    /// The model name requests use and the workers serve (it seeds the block hashes).
    pub model: String,
    /// A GGUF file (its metadata: tokenizer and chat template) or a `tokenizer.json` (chat
    /// template from the `tokenizer_config.json` beside it).
    pub path: std::path::PathBuf,
    /// Tokens per KV block on the workers (`kvgate worker --block-size`).
    #[serde(default = "defaults::block_size")]
    pub block_size: usize,
    /// Longest prompt plus output, in tokens: a longer prompt is refused with 400 before it is
    /// tokenized in full. Default: the GGUF's context length, else 131,072.
    #[serde(default)]
    pub context_length: Option<usize>,
}

/// The agents' bearer token from `path` (surrounding whitespace trimmed; must not be empty).
pub fn read_token(path: &std::path::Path) -> Result<String, String> {
    let token = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let token = token.trim();
    if token.is_empty() {
        return Err(format!("{} is empty", path.display()));
    }
    Ok(token.to_string())
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentsConfig {
    /// File holding the bearer token agents must present (read at load and at each reload).
    pub token_file: std::path::PathBuf,
    /// A replica whose agent has not reported for this long is scored down.
    #[serde(default = "defaults::stale_after_ms")]
    pub stale_after_ms: u64,
    /// ... and for this long, excluded until it reports again.
    #[serde(default = "defaults::exclude_after_ms")]
    pub exclude_after_ms: u64,
    /// `static`: reports update the replicas listed in `replicas` only; `open`: a report from
    /// a replica not listed adds it to the fleet.
    #[serde(default)]
    pub join: JoinMode,
}

/// The decision exchange between gateway replicas (see `crate::peers`): each pushes the
/// replica it chose for each request, with the prompt's leading hashes and its session, to
/// every peer's admin listener; a peer then counts that prefix and session as living there.
/// Bounded and lossy: no coordinator, nothing waits for it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeersConfig {
    /// The other gateways' admin listeners, `http(s)://HOST:PORT` (resolved at load).
    pub urls: Vec<String>,
    /// File holding the bearer token every gateway of the group presents and asks for (read
    /// at load and at each reload).
    pub token_file: std::path::PathBuf,
    /// Decisions and the backlog go out in one push per peer at most this often (the staler
    /// the peers' backlogs, the more gateways pile onto one replica: see BENCHMARKS.md).
    #[serde(default = "defaults::peer_interval_ms")]
    pub interval_ms: u64,
    /// Decisions waiting for the next push at most; past it the oldest are dropped.
    #[serde(default = "defaults::peer_max_pending")]
    pub max_pending: usize,
    /// A push not answered within this is given up (its decisions are lost to that peer).
    #[serde(default = "defaults::peer_timeout_ms")]
    pub timeout_ms: u64,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JoinMode {
    #[default]
    Static,
    Open,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Listen {
    One(String),
    Many(Vec<String>),
}

impl Listen {
    pub fn addresses(&self) -> &[String] {
        match self {
            Listen::One(a) => std::slice::from_ref(a),
            Listen::Many(v) => v,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplicaConfig {
    /// `http://IP:PORT` or `http://localhost:PORT` (resolved once, at load).
    pub url: String,
    /// Stable name: places the replica on the hash ring and labels its metrics. Default: the URL.
    #[serde(default)]
    pub id: Option<String>,
    /// Models it serves. Empty: discovered from its `/v1/models`.
    #[serde(default)]
    pub models: Vec<String>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Never more than this many requests in flight on it from this gateway.
    #[serde(default)]
    pub max_in_flight: Option<u32>,
}

impl ReplicaConfig {
    pub fn name(&self) -> &str {
        self.id.as_deref().unwrap_or(&self.url)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Largest request body accepted; larger ones get 413.
    pub max_body_bytes: u64,
    /// A request's header must arrive whole within this (after a kept-alive connection's idle
    /// time); else 408 and the connection closes.
    pub header_timeout_ms: u64,
    /// ... and its body within this; else 408 and the connection closes.
    pub body_timeout_ms: u64,
    /// A write to the client must go through within this (a client that takes none of its
    /// answer for this long, as nginx's `send_timeout`); else the connection closes and the
    /// upstream request is cancelled.
    pub send_timeout_ms: u64,
    /// Client connections open at once; more are closed as they come. Unset: three quarters
    /// of the process's open-file limit (raised to its hard limit at start).
    pub max_connections: Option<std::num::NonZeroU64>,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_body_bytes: 32 * 1024 * 1024,
            header_timeout_ms: 30_000,
            body_timeout_ms: 60_000,
            send_timeout_ms: 60_000,
            max_connections: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Timeouts {
    /// TCP connect to a replica.
    pub connect_ms: u64,
    /// From sending the request to the response header and to its first body chunk.
    pub first_byte_ms: u64,
    /// Longest gap between two body chunks of a response.
    pub idle_ms: u64,
    /// How long an idle pooled upstream connection is kept (below the workers' keep-alive).
    pub pool_idle_ms: u64,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            connect_ms: 2_000,
            first_byte_ms: 120_000,
            idle_ms: 60_000,
            pool_idle_ms: 30_000,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Retries {
    /// Replicas tried per request (connect failures, 503 and 429 move to the next one).
    pub attempts: u32,
}

impl Default for Retries {
    fn default() -> Self {
        Retries { attempts: 3 }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HealthConfig {
    /// Active check: GET this path; 2xx is healthy.
    pub path: String,
    pub interval_ms: u64,
    pub timeout_ms: u64,
    /// Passive ejection after this many consecutive failed requests or checks.
    pub eject_after_failures: u32,
    /// First ejection lasts this long; each further one doubles it, up to `ejection_max_ms`.
    pub ejection_base_ms: u64,
    pub ejection_max_ms: u64,
    /// How often replicas without configured models are asked for `/v1/models`.
    pub models_refresh_ms: u64,
}

impl Default for HealthConfig {
    fn default() -> Self {
        HealthConfig {
            path: "/health".into(),
            interval_ms: 1_000,
            timeout_ms: 1_000,
            eject_after_failures: 3,
            ejection_base_ms: 1_000,
            ejection_max_ms: 30_000,
            models_refresh_ms: 10_000,
        }
    }
}

mod defaults {
    pub fn threads() -> usize {
        2
    }
    pub fn shutdown_grace_ms() -> u64 {
        30_000
    }
    pub fn yes() -> bool {
        true
    }
    pub fn peer_interval_ms() -> u64 {
        2
    }
    pub fn peer_max_pending() -> usize {
        4_096
    }
    pub fn peer_timeout_ms() -> u64 {
        500
    }
    pub fn stale_after_ms() -> u64 {
        1_000
    }
    pub fn exclude_after_ms() -> u64 {
        5_000
    }
    pub fn block_size() -> usize {
        16
    }
    pub fn class_header() -> String {
        "x-kvgate-class".into()
    }
    pub fn max_queue() -> usize {
        256
    }
    pub fn queue_timeout_ms() -> u64 {
        30_000
    }
}
