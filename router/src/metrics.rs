//! The gateway's Prometheus metrics (`kvgate_` prefix, base units).

use prometheus::{
    Encoder, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];
const DECISION_BUCKETS: &[f64] = &[
    1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 1e-2,
];

pub struct Metrics {
    registry: Registry,
    /// By route, status code and replica ("none" when no replica answered).
    pub requests: IntCounterVec,
    /// Request arrival to the first response body byte from the replica, by route.
    pub ttft: HistogramVec,
    /// Request arrival to the end of the response, by route.
    pub e2e: HistogramVec,
    pub decision: Histogram,
    pub in_flight: IntGaugeVec,
    pub prefill_backlog: IntGaugeVec,
    pub healthy: IntGaugeVec,
    /// The breakdown of the last request sent to each replica: its total and every signal.
    pub last_score: GaugeVec,
    /// By reason: connect, status_503, status_429, stale_connection.
    pub retries: IntCounterVec,
    pub ejections: IntCounterVec,
    /// By replica and kind: connect, timeout, read, write, prefill, prefill_status.
    pub upstream_errors: IntCounterVec,
    /// Requests of disaggregated pools, by flow and path: prefill_decode (both legs),
    /// decode_only (a prompt below the pool's minimum), fallback (no prefill replica took it).
    pub pd_requests: IntCounterVec,
    pub client_disconnects: IntCounter,
    /// Of those, clients that took none of their answer for `limits.send_timeout_ms`.
    pub client_send_timeouts: IntCounter,
    /// Client connections open now, and those closed as they came (`limits.max_connections`).
    pub client_connections: IntGauge,
    pub connections_refused: IntCounter,
    pub reloads: IntCounterVec,
    /// Agent reports by result: accepted, unauthorized, rejected, missed (sequence gaps).
    pub agent_reports: IntCounterVec,
    /// KV-event batches from agents: applied, snapshot (received), resync (snapshot asked for).
    pub kv_event_batches: IntCounterVec,
    /// Decisions exchanged with peer gateways, by outcome: queued, dropped (the queue was
    /// full), sent, lost (a push failed), received, unknown_replica, rejected (a whole push).
    pub peer_decisions: IntCounterVec,
    /// Pushes to each peer gateway, by outcome: ok, failed.
    pub peer_pushes: IntCounterVec,
    /// Requests waiting for admission, by SLA class.
    pub queue_depth: IntGaugeVec,
    /// Requests refused admission, by class and reason: shed, queue_full, deadline.
    pub refused: IntCounterVec,
    /// Requests admitted per tenant.
    pub tenant_requests: IntCounterVec,
    /// Tokens charged per tenant (prompt plus max_tokens).
    pub tenant_tokens: IntCounterVec,
    /// Requests refused by a tenant's limits, by tenant and limit: concurrency, tokens.
    pub tenant_refused: IntCounterVec,
    /// Requests refused before reaching a tenant: a missing or unknown key.
    pub unauthorized: IntCounter,
    pub tenant_in_flight: IntGaugeVec,
}

impl Metrics {
    pub fn new() -> prometheus::Result<Self> {
        let registry = Registry::new();
        let counter =
            |name: &str, help: &str, labels: &[&str]| -> prometheus::Result<IntCounterVec> {
                let c = IntCounterVec::new(Opts::new(name, help), labels)?;
                registry.register(Box::new(c.clone()))?;
                Ok(c)
            };
        let gauge = |name: &str, help: &str, labels: &[&str]| -> prometheus::Result<IntGaugeVec> {
            let g = IntGaugeVec::new(Opts::new(name, help), labels)?;
            registry.register(Box::new(g.clone()))?;
            Ok(g)
        };
        let histogram = |name: &str, help: &str| -> prometheus::Result<HistogramVec> {
            let h = HistogramVec::new(
                HistogramOpts::new(name, help).buckets(LATENCY_BUCKETS.to_vec()),
                &["route"],
            )?;
            registry.register(Box::new(h.clone()))?;
            Ok(h)
        };
        let decision = Histogram::with_opts(
            HistogramOpts::new(
                "kvgate_routing_decision_seconds",
                "Time to rank replicas for one request",
            )
            .buckets(DECISION_BUCKETS.to_vec()),
        )?;
        registry.register(Box::new(decision.clone()))?;
        let client_disconnects = IntCounter::new(
            "kvgate_client_disconnects_total",
            "Clients that went away before their response ended (the upstream request is cancelled)",
        )?;
        registry.register(Box::new(client_disconnects.clone()))?;
        let client_send_timeouts = IntCounter::new(
            "kvgate_client_send_timeouts_total",
            "Clients disconnected for taking none of their answer for limits.send_timeout_ms",
        )?;
        registry.register(Box::new(client_send_timeouts.clone()))?;
        let client_connections =
            IntGauge::new("kvgate_client_connections", "Client connections open")?;
        registry.register(Box::new(client_connections.clone()))?;
        let connections_refused = IntCounter::new(
            "kvgate_connections_refused_total",
            "Client connections closed as they came, past limits.max_connections",
        )?;
        registry.register(Box::new(connections_refused.clone()))?;
        let unauthorized = IntCounter::new(
            "kvgate_unauthorized_total",
            "Requests refused for a missing or unknown API key",
        )?;
        registry.register(Box::new(unauthorized.clone()))?;
        Ok(Metrics {
            requests: counter(
                "kvgate_requests_total",
                "Requests answered",
                &["route", "status", "replica"],
            )?,
            ttft: histogram(
                "kvgate_time_to_first_token_seconds",
                "Arrival to the first response body byte (the first token when streaming)",
            )?,
            e2e: histogram(
                "kvgate_request_duration_seconds",
                "Arrival to end of response",
            )?,
            decision,
            in_flight: gauge(
                "kvgate_replica_in_flight",
                "Requests in flight per replica",
                &["replica"],
            )?,
            prefill_backlog: gauge(
                "kvgate_replica_prefill_backlog_tokens",
                "Prompt tokens sent to the replica that await their first token, less what it held",
                &["replica"],
            )?,
            healthy: gauge(
                "kvgate_replica_healthy",
                "1 if the replica is eligible for routing",
                &["replica"],
            )?,
            last_score: {
                let g = GaugeVec::new(
                    Opts::new(
                        "kvgate_replica_last_score",
                        "The last decision that sent a request to the replica: its total and each signal",
                    ),
                    &["replica", "signal"],
                )?;
                registry.register(Box::new(g.clone()))?;
                g
            },
            retries: counter(
                "kvgate_retries_total",
                "Requests moved to another replica",
                &["reason"],
            )?,
            ejections: counter(
                "kvgate_ejections_total",
                "Replicas ejected after failures",
                &["replica"],
            )?,
            upstream_errors: counter(
                "kvgate_upstream_errors_total",
                "Failed exchanges with replicas",
                &["replica", "kind"],
            )?,
            pd_requests: counter(
                "kvgate_pd_requests_total",
                "Requests of prefill/decode pools, by flow and the legs they took",
                &["flow", "path"],
            )?,
            client_disconnects,
            client_send_timeouts,
            client_connections,
            connections_refused,
            reloads: counter(
                "kvgate_config_reloads_total",
                "Configuration reloads",
                &["result"],
            )?,
            agent_reports: counter(
                "kvgate_agent_reports_total",
                "Telemetry reports from agents, by result",
                &["result"],
            )?,
            kv_event_batches: counter(
                "kvgate_kv_event_batches_total",
                "KV-event batches and snapshots relayed by agents, and snapshots asked for",
                &["result"],
            )?,
            peer_decisions: counter(
                "kvgate_peer_decisions_total",
                "Routing decisions exchanged with peer gateways, by outcome",
                &["outcome"],
            )?,
            peer_pushes: counter(
                "kvgate_peer_pushes_total",
                "Pushes of decisions to each peer gateway, by outcome",
                &["peer", "outcome"],
            )?,
            queue_depth: gauge(
                "kvgate_admission_queue_depth",
                "Requests waiting for room in the fleet, by SLA class",
                &["class"],
            )?,
            refused: counter(
                "kvgate_admission_refused_total",
                "Requests refused admission, by SLA class and reason",
                &["class", "reason"],
            )?,
            tenant_requests: counter(
                "kvgate_tenant_requests_total",
                "Requests admitted, by tenant",
                &["tenant"],
            )?,
            tenant_tokens: counter(
                "kvgate_tenant_tokens_total",
                "Tokens charged to each tenant (prompt plus max_tokens)",
                &["tenant"],
            )?,
            tenant_refused: counter(
                "kvgate_tenant_refused_total",
                "Requests refused by a tenant's limits, by tenant and limit",
                &["tenant", "limit"],
            )?,
            unauthorized,
            tenant_in_flight: gauge(
                "kvgate_tenant_in_flight",
                "Requests in flight per tenant",
                &["tenant"],
            )?,
            registry,
        })
    }

    /// The text exposition format.
    pub fn render(&self) -> Vec<u8> {
        let mut buf = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut buf) {
            tracing::error!(error = %e, "cannot encode metrics");
        }
        buf
    }
}
