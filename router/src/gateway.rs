//! The gateway's shared state: the current config snapshot, the replicas, the routing policy
//! and the metrics. A reload swaps the snapshot; requests already running keep the one they
//! started with, so none fails because of a reload.

use crate::admission::{Admission, Refused};
use crate::classes::Class;
use crate::config::{self, ConfigError, GatewayConfig};
use crate::in_flight::InFlight;
use crate::metrics::Metrics;
use crate::replica::Replica;
pub use crate::snapshot::Snapshot;
use crate::snapshot::{
    build_classes, build_replicas, build_tenants, config_error, read_tokens, same_server, Tokens,
};
use crate::tokenizers::{self, TokenModes};
use crate::upstream_connectors::UpstreamConnectors;
use kvgate_policies::{
    Applied, Ask, Candidate, Decision, Ejection, FailureOutcome, FleetState, NoRoute, ReportAges,
    ReportOutcome, RequestFeatures,
};
use kvgate_protocol::telemetry::{KvUpdate, TelemetryReport};
use kvgate_protocol::{ApiError, ErrorKind};
use pingora_core::connectors::http::Connector;
use pingora_core::connectors::ConnectorOptions;
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};
use std::time::Instant;

pub struct Gateway {
    config_path: Option<PathBuf>,
    current: RwLock<Arc<Snapshot>>,
    /// The bearer tokens, read from their files at load and reload.
    tokens: RwLock<Tokens>,
    /// Replicas that joined by reporting (`agents.join: open`), kept across reloads.
    joined: Mutex<Vec<config::ReplicaConfig>>,
    /// The clock the fleet state is kept by.
    epoch: Instant,
    /// Every replica's live state and the policy's: see [`FleetState`].
    fleet: Arc<Mutex<FleetState>>,
    next_request: AtomicU64,
    pub admission: Admission,
    pub metrics: Metrics,
    /// Opens upstream connections, one per thread.
    connectors: UpstreamConnectors,
    /// Idle connections to the replicas, per thread, for proxied requests.
    pub(crate) idle: crate::idle_pool::IdlePool,
    /// Large request bodies parsed (and tokenized) at once, each on a blocking thread.
    pub parse_slots: tokio::sync::Semaphore,
    /// Requests in flight and the grace period of a stop.
    pub drain: crate::drain::Drain,
    pub connections: crate::connections::Connections,
    /// The listeners' certificate, when they serve TLS.
    pub certificate: Option<Arc<crate::tls::Certificate>>,
    /// Decisions waiting to be pushed to peer gateways (with `peers:`).
    pub outbox: crate::peers::Outbox,
    /// This gateway process as its peers know it.
    pub peer_id: u64,
    /// Requests given a tie draw (see [`Gateway::tie_draw`]).
    draws: AtomicU64,
}

/// A routing outcome: the replicas to try in order, the first already counted in flight.
pub struct Route {
    pub ranked: Vec<(Arc<Replica>, Candidate)>,
    pub first: InFlight,
    pub load_bound: u32,
}

impl Gateway {
    pub fn new(
        config: GatewayConfig,
        config_path: Option<PathBuf>,
    ) -> Result<Self, Vec<ConfigError>> {
        let metrics = Metrics::new().map_err(|e| {
            vec![ConfigError {
                path: ".".into(),
                line: None,
                message: format!("metrics: {e}"),
            }]
        })?;
        let mut fleet = FleetState::new(config.policy.clone(), report_ages(&config));
        fleet.set_peer_group(crate::peers::group_size(&config));
        let replicas = build_replicas(&config, &[], &[])?;
        let tokens = read_tokens(&config)?;
        let tokenizers = tokenizers::load(&config, &TokenModes::new())?;
        let classes = build_classes(&config)?;
        let tenants = build_tenants(&config, None);
        let certificate = config
            .tls
            .as_ref()
            .map(|tls| crate::tls::Certificate::load(tls).map(Arc::new))
            .transpose()
            .map_err(|message| config_error("tls", message))?;
        let connector_options = ConnectorOptions {
            ca_file: config
                .upstream_ca_file
                .as_ref()
                .map(|p| p.display().to_string()),
            ..ConnectorOptions::new(UPSTREAM_POOL)
        };
        // The proxy threads' and the health checks'.
        let threads_ahead = config.threads + 1;
        let gateway = Gateway {
            config_path,
            current: RwLock::new(Arc::new(Snapshot {
                config,
                replicas,
                tokenizers,
                classes,
                tenants,
            })),
            tokens: RwLock::new(tokens),
            joined: Mutex::new(Vec::new()),
            epoch: Instant::now(),
            fleet: Arc::new(Mutex::new(fleet)),
            next_request: AtomicU64::new(0),
            admission: Admission::default(),
            metrics,
            connectors: UpstreamConnectors::new(connector_options, threads_ahead),
            idle: Default::default(),
            parse_slots: tokio::sync::Semaphore::new(
                std::thread::available_parallelism().map_or(1, |n| n.get()),
            ),
            drain: Default::default(),
            connections: Default::default(),
            certificate,
            outbox: Default::default(),
            peer_id: crate::peers::new_peer_id(),
            draws: AtomicU64::new(0),
        };
        gateway.sync_fleet_members();
        Ok(gateway)
    }

    /// This thread's upstream connector (see `upstream_connectors.rs`).
    pub fn connector(&self) -> &Connector {
        self.connectors.get()
    }

    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Re-reads the config file; on any error the running config is kept.
    pub fn reload(&self) -> Result<(), Vec<ConfigError>> {
        let result = match &self.config_path {
            Some(path) => config::load_file_warning(path).and_then(|c| self.apply(c)),
            None => Err(vec![ConfigError {
                path: ".".into(),
                line: None,
                message: "the gateway was not started from a config file".into(),
            }]),
        };
        let label = if result.is_ok() { "success" } else { "failure" };
        self.metrics.reloads.with_label_values(&[label]).inc();
        result
    }

    /// Installs a validated config. Replicas whose settings are unchanged keep their state.
    pub fn apply(&self, config: GatewayConfig) -> Result<(), Vec<ConfigError>> {
        let old = self.snapshot();
        if config.listen != old.config.listen || config.admin_listen != old.config.admin_listen {
            tracing::warn!("listener changes take effect only after a restart");
        }
        let joined = self.joined.lock().unwrap_or_else(PoisonError::into_inner);
        let replicas = build_replicas(&config, &joined, &old.replicas)?;
        let tokens = read_tokens(&config)?;
        let tokenizers = tokenizers::load(&config, &old.tokenizers)?;
        let classes = build_classes(&config)?;
        let tenants = build_tenants(&config, old.tenants.as_ref());
        match (&self.certificate, &config.tls) {
            (Some(certificate), Some(tls)) => certificate
                .reload(tls)
                .map_err(|message| config_error("tls", message))?,
            (None, None) => {}
            _ => tracing::warn!("turning TLS on or off takes effect only after a restart"),
        }
        if config.upstream_ca_file != old.config.upstream_ca_file {
            tracing::warn!("upstream_ca_file changes take effect only after a restart");
        }
        *self.tokens.write().unwrap_or_else(PoisonError::into_inner) = tokens;
        {
            let mut fleet = self.fleet();
            fleet.set_config(config.policy.clone(), report_ages(&config));
            fleet.set_peer_group(crate::peers::group_size(&config));
        }
        *self.current.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(Snapshot {
            config,
            replicas,
            tokenizers,
            classes,
            tenants,
        });
        drop(joined);
        self.sync_fleet_members();
        tracing::info!("configuration reloaded");
        Ok(())
    }

    /// Milliseconds since the gateway started.
    pub fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// The same clock in microseconds: engine steps take a few milliseconds.
    pub fn now_us(&self) -> u64 {
        self.epoch.elapsed().as_micros() as u64
    }

    /// The bearer tokens (admin API, agents, peers) as last read from their files.
    pub(crate) fn tokens(&self) -> std::sync::RwLockReadGuard<'_, Tokens> {
        self.tokens.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// The replica a report is about (by name, else by URL); with `agents.join: open` an
    /// unknown one joins the fleet.
    pub fn replica_for_report(&self, report: &TelemetryReport) -> Result<Arc<Replica>, ApiError> {
        let find = |snap: &Snapshot| {
            snap.replicas
                .iter()
                .find(|r| r.name == report.replica)
                .or_else(|| snap.replicas.iter().find(|r| r.config.url == report.url))
                .cloned()
        };
        if let Some(r) = find(&self.snapshot()) {
            // Another agent using this replica's name would void its cache state with every
            // report (each looks like a restart).
            if !same_server(&r.config.url, &report.url) {
                return Err(ApiError::new(
                    ErrorKind::Forbidden,
                    format!(
                        "replica `{}` is {}, but this report is for {}: another agent uses its name?",
                        r.name, r.config.url, report.url
                    ),
                ));
            }
            return Ok(r);
        }
        let open = self
            .snapshot()
            .config
            .agents
            .as_ref()
            .is_some_and(|a| a.join == config::JoinMode::Open);
        if !open {
            return Err(ApiError::new(
                ErrorKind::NotFound,
                format!(
                    "replica `{}` ({}) is not in the fleet, and `agents.join` is `static`",
                    report.replica, report.url
                ),
            ));
        }
        config::resolve_url(&report.url)
            .map_err(|e| ApiError::new(ErrorKind::InvalidRequest, format!("report url: {e}")))?;
        if report.replica.trim().is_empty() {
            return Err(ApiError::new(
                ErrorKind::InvalidRequest,
                "report replica is empty",
            ));
        }
        // Joining rebuilds the snapshot; the lock keeps two joins from racing.
        let mut joined = self.joined.lock().unwrap_or_else(PoisonError::into_inner);
        let old = self.snapshot();
        if let Some(r) = find(&old) {
            return Ok(r);
        }
        joined.push(config::ReplicaConfig {
            url: report.url.clone(),
            id: Some(report.replica.clone()),
            models: Vec::new(),
            labels: Default::default(),
            max_in_flight: None,
        });
        let replicas = build_replicas(&old.config, &joined, &old.replicas).map_err(|e| {
            joined.pop();
            let e: Vec<String> = e.iter().map(ToString::to_string).collect();
            ApiError::new(ErrorKind::InvalidRequest, e.join("; "))
        })?;
        let snap = Arc::new(Snapshot {
            config: old.config.clone(),
            replicas,
            tokenizers: old.tokenizers.clone(),
            classes: old.classes.clone(),
            tenants: old.tenants.clone(),
        });
        let joined_replica = find(&snap);
        *self.current.write().unwrap_or_else(PoisonError::into_inner) = snap;
        drop(joined);
        self.sync_fleet_members();
        tracing::info!(replica = %report.replica, url = %report.url, "replica joined by reporting");
        joined_replica.ok_or_else(|| ApiError::new(ErrorKind::Internal, "joined replica vanished"))
    }

    /// The fleet state, locked.
    pub fn fleet(&self) -> MutexGuard<'_, FleetState> {
        self.fleet.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes a report from a replica's agent (without its KV events: [`Gateway::apply_kv`]).
    pub fn record_report(&self, replica: &Replica, report: &TelemetryReport) -> ReportOutcome {
        let now = self.now_ms();
        self.fleet()
            .report(replica.slot, report, now)
            .unwrap_or(ReportOutcome {
                restarted: false,
                missed: 0,
            })
    }

    /// Applies the KV events a replica's agent relayed to the precise prefix index.
    pub fn apply_kv(&self, replica: &Replica, update: &KvUpdate) -> Applied {
        self.fleet().kv_events(replica.slot, update)
    }

    /// A request to `replica` failed; see [`FleetState::failed`].
    pub fn replica_failed(
        &self,
        replica: &Replica,
        health: &config::HealthConfig,
    ) -> FailureOutcome {
        let now = self.now_ms();
        self.fleet().failed(replica.slot, now, ejection(health))
    }

    /// A request to `replica` succeeded; see [`FleetState::succeeded`].
    pub fn replica_succeeded(&self, replica: &Replica) {
        self.fleet().succeeded(replica.slot);
    }

    /// An active health check's result; see [`FleetState::checked`].
    pub fn replica_checked(
        &self,
        replica: &Replica,
        passed: bool,
        health: &config::HealthConfig,
    ) -> FailureOutcome {
        let now = self.now_ms();
        self.fleet()
            .checked(replica.slot, passed, now, ejection(health))
    }

    pub fn is_ejected(&self, replica: &Replica) -> bool {
        let now = self.now_ms();
        self.fleet()
            .replica(replica.slot)
            .is_some_and(|r| r.is_ejected(now))
    }

    pub fn set_discovered_models(&self, replica: &Replica, models: Vec<String>) {
        self.fleet().set_discovered_models(replica.slot, models);
    }

    /// The models `replica` serves: configured, else discovered; `None` while unknown.
    pub fn models_of(&self, replica: &Replica) -> Option<Vec<String>> {
        self.fleet()
            .replica(replica.slot)
            .and_then(|r| r.models().map(<[String]>::to_vec))
    }

    /// Every model some replica serves.
    pub fn models(&self) -> BTreeSet<String> {
        let fleet = self.fleet();
        fleet
            .replicas()
            .filter_map(|(_, r)| r.models())
            .flatten()
            .cloned()
            .collect()
    }

    fn sync_fleet_members(&self) {
        let snap = self.snapshot();
        self.fleet()
            .set_replicas(snap.replicas.iter().map(|r| (r.slot, r.spec())).collect());
    }

    /// A request's draw for a tie within `tie_margin` (`RequestFeatures::tie_draw`): a count
    /// hashed with this process's id, so that gateways beside each other draw apart.
    pub fn tie_draw(&self) -> u64 {
        let n = self.draws.fetch_add(1, Ordering::Relaxed);
        xxhash_rust::xxh3::xxh3_64_with_seed(&n.to_le_bytes(), self.peer_id)
    }

    /// Ranks the replicas for a request on `model` and sends it to the top one: counted in
    /// flight there before the fleet state is unlocked, so concurrent decisions see each other.
    pub fn route(
        &self,
        snap: &Snapshot,
        model: &str,
        features: &RequestFeatures,
        class: Option<&Class>,
    ) -> Result<Route, ApiError> {
        let top = snap.config.retries.attempts.max(1) as usize;
        let id = self.next_request.fetch_add(1, Ordering::Relaxed);
        let started = Instant::now();
        let now = self.now_ms();
        let (decision, steps) = {
            let mut fleet = self.fleet();
            let decision = fleet.route(id, &ask(model, features, class), now, top);
            let steps = decision
                .as_ref()
                .ok()
                .and_then(|d| fleet.step_clock(d.ranked[0].replica));
            (decision, steps)
        };
        self.metrics
            .decision
            .observe(started.elapsed().as_secs_f64());
        let decision = decision.map_err(|e| no_route(e, class))?;
        let first = InFlight::new(
            Arc::clone(&self.fleet),
            Arc::clone(&self.admission.released),
            id,
            steps,
        );
        let route = self.route_of(snap, decision, first);
        if let (Some(peers), Some((replica, _))) = (&snap.config.peers, route.ranked.first()) {
            let decision = crate::peers::PeerDecision::new(&replica.name, features);
            self.outbox
                .queue(decision, peers.max_pending, &self.metrics);
        }
        Ok(route)
    }

    /// The ranked replicas of a decision, by slot.
    fn route_of(&self, snap: &Snapshot, decision: Decision, first: InFlight) -> Route {
        let Decision {
            ranked, load_bound, ..
        } = decision;
        let ranked = ranked
            .into_iter()
            .filter_map(|c| {
                snap.replicas
                    .iter()
                    .find(|r| r.slot == c.replica)
                    .map(|r| (Arc::clone(r), c))
            })
            .collect();
        Route {
            ranked,
            first,
            load_bound,
        }
    }

    /// Sends a request to another ranked replica (a retry): it leaves the previous one.
    pub fn resend(&self, choice: &Candidate, features: &RequestFeatures) -> InFlight {
        let id = self.next_request.fetch_add(1, Ordering::Relaxed);
        let now = self.now_ms();
        let steps = {
            let mut fleet = self.fleet();
            fleet.send(id, choice, features, now);
            fleet.step_clock(choice.replica)
        };
        InFlight::new(
            Arc::clone(&self.fleet),
            Arc::clone(&self.admission.released),
            id,
            steps,
        )
    }

    /// Admits a request of `class` (see [`crate::admission`]; at once without SLA classes),
    /// then routes it.
    pub async fn admit(
        &self,
        snap: &Snapshot,
        model: &str,
        features: &RequestFeatures,
        class: Option<&Arc<Class>>,
    ) -> Result<Route, ApiError> {
        let Some(class) = class else {
            return self.route(snap, model, features, None);
        };
        let has_room = |model: &str, class: &Class| {
            let now = self.now_ms();
            self.fleet()
                .has_room(&ask(model, features, Some(class)), now)
        };
        let depth = |d: usize| {
            self.metrics
                .queue_depth
                .with_label_values(&[&class.name])
                .set(d as i64)
        };
        let take = || self.route(snap, model, features, Some(class));
        match self
            .admission
            .admit(class, model, has_room, take, depth)
            .await
        {
            Ok(routed) => routed,
            Err((error, why)) => {
                self.metrics
                    .refused
                    .with_label_values(&[&class.name, why.label()])
                    .inc();
                if why == Refused::Deadline {
                    tracing::debug!(class = %class.name, "request left the queue at its deadline");
                }
                Err(error)
            }
        }
    }

    /// Explains a decision without sending anything (admin API).
    pub fn explain(
        &self,
        model: &str,
        features: &RequestFeatures,
        class: Option<&Class>,
    ) -> Result<serde_json::Value, ApiError> {
        let snap = self.snapshot();
        let now = self.now_ms();
        let fleet = self.fleet();
        let decision = fleet
            .rank(&ask(model, features, class), now, usize::MAX)
            .map_err(|e| no_route(e, class))?;
        // Token mode: which of the blocks each holds are on its device, which in a lower tier.
        let index = fleet.policy().precise_index();
        let held = |replica| {
            (!features.block_hashes.is_empty())
                .then(|| index.held_by_tier(&features.block_hashes, replica))
        };
        let name = |slot| {
            snap.replicas
                .iter()
                .find(|r| r.slot == slot)
                .map(|r| r.name.as_str())
        };
        let candidates: Vec<serde_json::Value> = decision
            .ranked
            .iter()
            .map(|c| serde_json::json!({ "replica": name(c.replica), "score": c, "held_blocks": held(c.replica) }))
            .collect();
        Ok(
            serde_json::json!({ "model": model, "gateways": fleet.gateways(), "gateways_seen": fleet.gateways_seen(), "load_bound": decision.load_bound, "hot_group": decision.hot_group, "opens_session": decision.opens_session, "session_past_cache": decision.session_past_cache, "tied": decision.tied, "candidates": candidates }),
        )
    }
}

/// What `class` asks of the fleet for a request on `model`.
fn ask<'a>(model: &'a str, features: &'a RequestFeatures, class: Option<&'a Class>) -> Ask<'a> {
    static ANY: BTreeMap<String, String> = BTreeMap::new();
    Ask {
        model,
        pool: class.map_or(&ANY, |c| &c.pool),
        features,
    }
}

fn no_route(e: NoRoute, class: Option<&Class>) -> ApiError {
    match e {
        NoRoute::NoneHealthy { .. } => ApiError::new(ErrorKind::Unavailable, e.to_string()),
        NoRoute::NotInPool { model, pool } => ApiError::new(
            ErrorKind::ModelNotFound,
            format!(
                "model `{model}` is not served by any replica in the pool of class `{}` ({pool:?})",
                class.map_or("", |c| c.name.as_str())
            ),
        )
        .with_param("model"),
        NoRoute::UnknownModel { .. } => {
            ApiError::new(ErrorKind::ModelNotFound, e.to_string()).with_param("model")
        }
    }
}

fn report_ages(config: &GatewayConfig) -> Option<ReportAges> {
    config.agents.as_ref().map(|a| ReportAges {
        stale_after_ms: a.stale_after_ms,
        exclude_after_ms: a.exclude_after_ms,
    })
}

fn ejection(health: &config::HealthConfig) -> Ejection {
    Ejection {
        after_failures: health.eject_after_failures,
        base_ms: health.ejection_base_ms,
        max_ms: health.ejection_max_ms,
    }
}

/// Idle connections kept per upstream and thread (Pingora's default).
const UPSTREAM_POOL: usize = 128;
