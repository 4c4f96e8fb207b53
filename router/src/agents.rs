//! Reports from agents (`POST /agent/report` on the admin listener): authenticated with the
//! bearer token of `agents.token_file`, compared in constant time; they update the replica's
//! load, KV and health as its agent sees them, and with `agents.join: open` add replicas the
//! config does not list. A report from a restarted worker voids what the gateway learnt about
//! its cache. KV events in a report feed the precise prefix index; when they cannot be applied
//! in sequence, the reply asks the agent for a snapshot.

use crate::gateway::Gateway;
use kvgate_protocol::telemetry::{ReportReply, TelemetryReport, MAX_GATEWAYS, TELEMETRY_VERSION};
use kvgate_protocol::{ApiError, ErrorKind};

/// Handles one report; returns the status and JSON body to answer with.
pub fn take_report(gateway: &Gateway, authorization: Option<&[u8]>, body: &[u8]) -> (u16, Vec<u8>) {
    match accept(gateway, authorization, body) {
        Ok(reply) => (200, serde_json::to_vec(&reply).unwrap_or_default()),
        Err(e) => {
            gateway
                .metrics
                .agent_reports
                .with_label_values(&[if e.kind == ErrorKind::Unauthorized {
                    "unauthorized"
                } else {
                    "rejected"
                }])
                .inc();
            (e.kind.status(), e.to_json())
        }
    }
}

fn accept(
    gateway: &Gateway,
    authorization: Option<&[u8]>,
    body: &[u8],
) -> Result<ReportReply, ApiError> {
    crate::bearer::check(
        gateway.tokens().agent.clone(),
        authorization,
        "agent reports are off (the config has no `agents` section)",
        "agents.token_file",
    )?;
    let mut report: TelemetryReport = serde_json::from_slice(body)
        .map_err(|e| ApiError::new(ErrorKind::InvalidRequest, format!("bad report: {e}")))?;
    if report.version != TELEMETRY_VERSION {
        return Err(ApiError::new(
            ErrorKind::InvalidRequest,
            format!(
                "report version {} is not supported (this gateway speaks {TELEMETRY_VERSION})",
                report.version
            ),
        ));
    }
    if let Some(n) = report.gateways.filter(|n| !(1..=MAX_GATEWAYS).contains(n)) {
        return Err(ApiError::new(
            ErrorKind::InvalidRequest,
            format!("bad report: `gateways` is {n}; 1 to {MAX_GATEWAYS} are accepted"),
        ));
    }
    let replica = gateway.replica_for_report(&report)?;
    let kv = report.kv.take();
    let outcome = gateway.record_report(&replica, &report);
    if outcome.restarted {
        tracing::info!(replica = %replica.name, "worker restarted: forgot its cached prefixes");
    }
    let mut reply = ReportReply {
        status: "ok".into(),
        kv_snapshot: false,
    };
    if let Some(kv) = kv {
        let applied = gateway.apply_kv(&replica, &kv);
        let count = |label: &str, n: usize| {
            gateway
                .metrics
                .kv_event_batches
                .with_label_values(&[label])
                .inc_by(n as u64)
        };
        count("applied", applied.batches);
        count("snapshot", usize::from(kv.snapshot.is_some()));
        if applied.needs_snapshot {
            count("resync", 1);
            reply.kv_snapshot = true;
        }
    }
    if outcome.missed > 0 {
        gateway
            .metrics
            .agent_reports
            .with_label_values(&["missed"])
            .inc_by(outcome.missed);
    }
    gateway
        .metrics
        .agent_reports
        .with_label_values(&["accepted"])
        .inc();
    Ok(reply)
}
