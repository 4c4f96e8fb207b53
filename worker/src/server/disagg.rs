//! Prefill/decode roles over vLLM's hand-over: a request whose `kv_transfer_params` ask for
//! remote decode is a prefill leg (computed, answered whole, its prompt's blocks kept for a
//! pull, and the response's `kv_transfer_params` saying where); one that names a remote
//! prefill is a decode leg (the blocks pulled first, then generated here). A pull that fails
//! costs only time: what did not arrive intact is computed.

use super::engine_loop::Command;
use super::http::Context;
use crate::transfer::{self, Transfer, TransferServer, TransferStore};
use kvgate_protocol::{ApiError, ErrorKind};
use serde_json::{json, Value};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// What a worker does in a disaggregated fleet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Computes prompts and serves their blocks.
    Prefill,
    /// Pulls prompts' blocks and generates.
    Decode,
    Both,
}

impl std::str::FromStr for Role {
    type Err = String;
    fn from_str(s: &str) -> Result<Role, String> {
        match s {
            "prefill" => Ok(Role::Prefill),
            "decode" => Ok(Role::Decode),
            "both" => Ok(Role::Both),
            _ => Err(format!("role must be prefill, decode or both, got `{s}`")),
        }
    }
}

impl Role {
    pub fn prefills(self) -> bool {
        matches!(self, Role::Prefill | Role::Both)
    }

    pub fn decodes(self) -> bool {
        matches!(self, Role::Decode | Role::Both)
    }
}

#[derive(Debug, Clone)]
pub struct DisaggConfig {
    pub role: Role,
    /// Where a prefill worker listens for pulls (port 0: any free port).
    pub transfer_addr: SocketAddr,
    /// How long a decode worker waits for a pull before computing the prompt itself.
    pub pull_timeout: Duration,
    /// Bytes of finished prompts' blocks a prefill worker keeps for pulls.
    pub store_bytes: usize,
    /// How long a prefill worker keeps a prompt's blocks for its pull.
    pub store_ttl: Duration,
}

/// The HTTP side's part: the prefill side's store and listener, the decode side's limits.
pub struct Disagg {
    role: Role,
    /// A prefill role's: the prompts kept for their pulls, and where decode workers pull.
    serving: Option<(Arc<TransferStore>, SocketAddr)>,
    pull_timeout: Duration,
    /// Most bytes one pull takes: the host tier's size, where pulled blocks land.
    max_pull_bytes: usize,
}

impl Disagg {
    /// Starts the transfer listener of a prefill role on the current runtime.
    pub async fn start(config: &DisaggConfig, host_tier_bytes: usize) -> Result<Disagg, String> {
        let mut serving = None;
        if config.role.prefills() {
            let store = Arc::new(TransferStore::new(config.store_bytes, config.store_ttl));
            let server = TransferServer::bind(config.transfer_addr).await?;
            tracing::info!(addr = %server.local_addr(), "serving prompts' KV blocks to decode workers");
            serving = Some((Arc::clone(&store), server.local_addr()));
            tokio::spawn(transfer::serve(server, store));
        }
        Ok(Disagg {
            role: config.role,
            serving,
            pull_timeout: config.pull_timeout,
            max_pull_bytes: host_tier_bytes,
        })
    }
}

impl Disagg {
    /// The transfers waiting for their pulls, into `metrics`.
    pub fn record_waiting(&self, metrics: &super::metrics::Metrics) {
        let Some((store, _)) = &self.serving else {
            return;
        };
        let (transfers, bytes) = store.usage();
        metrics.transfers_waiting.set(transfers as i64);
        metrics.transfers_waiting_bytes.set(bytes as i64);
    }
}

/// Which leg of a disaggregated request this is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Leg {
    Whole,
    Prefill,
    Decode { host: String, port: u16, id: u64 },
}

fn invalid(message: String) -> ApiError {
    ApiError::new(ErrorKind::InvalidRequest, message).with_param("kv_transfer_params")
}

/// The leg `params` ask for, checked against this worker's role and the request's shape.
pub fn leg(
    disagg: Option<&Disagg>,
    params: Option<&Value>,
    stream: bool,
    n: u32,
) -> Result<Leg, ApiError> {
    let Some(params) = params.filter(|p| !p.is_null()) else {
        return Ok(Leg::Whole);
    };
    let flag = |name: &str| params.get(name).and_then(Value::as_bool) == Some(true);
    let role = disagg.map(|d| d.role);
    if flag("do_remote_decode") {
        if !role.is_some_and(Role::prefills) {
            return Err(invalid(
                "this worker does not prefill for others (start it with --role prefill or both)"
                    .into(),
            ));
        }
        if stream || n != 1 {
            return Err(invalid(
                "a prefill leg is answered whole with one choice: set stream false and n 1".into(),
            ));
        }
        return Ok(Leg::Prefill);
    }
    if !flag("do_remote_prefill") {
        return Ok(Leg::Whole);
    }
    if !role.is_some_and(Role::decodes) {
        return Err(invalid(
            "this worker does not pull prefills (start it with --role decode or both)".into(),
        ));
    }
    let host = params.get("remote_host").and_then(Value::as_str);
    let port = params.get("remote_port").and_then(Value::as_u64);
    let id = params.get("transfer_id").and_then(Value::as_str);
    let (Some(host), Some(port), Some(id)) = (host, port, id) else {
        return Err(invalid(
            "a decode leg needs remote_host, remote_port and transfer_id, as the prefill leg's response gave them".into(),
        ));
    };
    let id = u64::from_str_radix(id, 16)
        .map_err(|_| invalid(format!("transfer_id must be 16 hex digits, got `{id}`")))?;
    let port =
        u16::try_from(port).map_err(|_| invalid(format!("remote_port {port} is not a port")))?;
    Ok(Leg::Decode {
        host: host.to_string(),
        port,
        id,
    })
}

/// A decode leg's pull: the prompt's blocks this worker lacks, from the prefill worker at
/// `host:port` that computed them, into the host tier, within the deadline (the name's
/// lookup included). Never fails the request.
pub async fn pull_prefix(ctx: &Context, prompt: &[u32], host: &str, port: u16, id: u64) {
    let Some(disagg) = &ctx.disagg else { return };
    let metrics = &ctx.shared.metrics;
    let started = Instant::now();
    let lookup = tokio::time::timeout(disagg.pull_timeout, tokio::net::lookup_host((host, port)));
    let Some(from) = lookup
        .await
        .ok()
        .and_then(Result::ok)
        .and_then(|mut a| a.next())
    else {
        metrics
            .transfer_failures
            .with_label_values(&["unreachable"])
            .inc();
        tracing::warn!(%host, "the prefill worker's host does not resolve: computing the prompt");
        return;
    };
    let (tx, rx) = oneshot::channel();
    let held = Command::Held {
        prompt: prompt.to_vec(),
        reply: tx,
    };
    if ctx.commands.send(held).await.is_err() {
        return;
    }
    let Ok((chain, held)) = rx.await else { return };
    let left = disagg.pull_timeout.saturating_sub(started.elapsed());
    let pulled = transfer::pull(from, id, &chain, &held, left, disagg.max_pull_bytes).await;
    metrics
        .transfer_seconds
        .observe(started.elapsed().as_secs_f64());
    if let Some(e) = &pulled.error {
        metrics
            .transfer_failures
            .with_label_values(&[e.reason()])
            .inc();
        tracing::warn!(%from, error = %e, blocks = pulled.blocks.len(), "block pull ended early: computing the rest");
    }
    let sent = pulled.blocks.len();
    let (tx, rx) = oneshot::channel();
    let import = Command::Import {
        blocks: pulled.blocks,
        reply: tx,
    };
    if ctx.commands.send(import).await.is_err() {
        return;
    }
    match rx.await {
        Ok(Ok(taken)) => {
            metrics
                .transfer_blocks
                .with_label_values(&["received"])
                .inc_by(taken as u64);
            if taken < sent {
                metrics
                    .transfer_failures
                    .with_label_values(&["wrong_size"])
                    .inc();
                tracing::warn!(%from, sent, taken, "blocks of the wrong size left out: another model's?");
            }
        }
        Ok(Err(e)) => tracing::warn!(error = %e, "pulled blocks not taken"),
        Err(_) => {}
    }
}

/// A prefill leg's response, `body`, with the hand-over added: the prompt's blocks kept for
/// one pull, and where. `local_ip` is the address the request reached this worker at, said
/// when the listener is on every interface.
pub async fn offer(ctx: &Context, prompt: &[u32], body: Vec<u8>, local_ip: IpAddr) -> Vec<u8> {
    let Some((store, listening)) = ctx.disagg.as_ref().and_then(|d| d.serving.as_ref()) else {
        return body;
    };
    let (tx, rx) = oneshot::channel();
    let export = Command::Export {
        prompt: prompt.to_vec(),
        reply: tx,
    };
    let blocks = match ctx.commands.send(export).await {
        Ok(()) => rx.await.unwrap_or_default(),
        Err(_) => Vec::new(),
    };
    let count = blocks.len();
    // Nothing to pull (a prompt under one block): the decode leg computes it.
    let id = (count > 0)
        .then(|| store.keep(Transfer { blocks }, Instant::now()))
        .flatten();
    let params = match id {
        Some(id) => {
            ctx.shared
                .metrics
                .transfer_blocks
                .with_label_values(&["offered"])
                .inc_by(count as u64);
            let ip = if listening.ip().is_unspecified() {
                local_ip
            } else {
                listening.ip()
            };
            json!({
                "do_remote_prefill": true,
                "do_remote_decode": false,
                "remote_engine_id": format!("kvgate-{}", ctx.served_name),
                "remote_host": ip.to_string(),
                "remote_port": listening.port(),
                "transfer_id": format!("{id:016x}"),
                "remote_block_count": count,
                "tp_size": 1,
            })
        }
        // Nothing kept (no full block, or over the store's size): the decode leg computes it.
        None => json!({ "do_remote_prefill": false, "do_remote_decode": false }),
    };
    with_field(body, "kv_transfer_params", params)
}

fn with_field(body: Vec<u8>, name: &str, value: Value) -> Vec<u8> {
    match serde_json::from_slice::<Value>(&body) {
        Ok(Value::Object(mut object)) => {
            object.insert(name.into(), value);
            serde_json::to_vec(&object).unwrap_or(body)
        }
        _ => body,
    }
}
