//! The gateway's shared state: the current config snapshot, the replicas, the routing policy
//! and the metrics. A reload swaps the snapshot; requests already running keep the one they
//! started with, so none fails because of a reload.

use crate::admission::{Admission, Refused};
use crate::classes::Class;
use crate::config::{self, ConfigError, GatewayConfig};
use crate::metrics::Metrics;
use crate::replica::{AdapterStatus, Freshness, InFlight, ModelMatch, Replica};
pub use crate::snapshot::Snapshot;
use crate::snapshot::{
    build_classes, build_replicas, build_tenants, config_error, read_tokens, same_server, Tokens,
};
use crate::tokenizers::{self, TokenModes};
use kvgate_policies::{
    Applied, Candidate, Decision, FleetView, Policy, ReplicaId, ReplicaView, RequestFeatures,
};
use kvgate_protocol::telemetry::{KvUpdate, TelemetryReport};
use kvgate_protocol::{ApiError, ErrorKind};
use pingora_core::connectors::http::Connector;
use pingora_core::connectors::ConnectorOptions;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Instant;

pub struct Gateway {
    config_path: Option<PathBuf>,
    current: RwLock<Arc<Snapshot>>,
    /// The bearer tokens, read from their files at load and reload.
    tokens: RwLock<Tokens>,
    /// Replicas that joined by reporting (`agents.join: open`), kept across reloads.
    joined: Mutex<Vec<config::ReplicaConfig>>,
    /// The clock routing state (session bindings) is kept by.
    epoch: Instant,
    policy: Mutex<Policy>,
    pub admission: Admission,
    pub metrics: Metrics,
    pub connector: Connector,
    /// Large request bodies parsed (and tokenized) at once, each on a blocking thread.
    pub parse_slots: tokio::sync::Semaphore,
    /// Requests in flight and the grace period of a stop.
    pub drain: crate::drain::Drain,
    /// The listeners' certificate, when they serve TLS.
    pub certificate: Option<Arc<crate::tls::Certificate>>,
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
        let policy = Policy::new(config.policy.clone());
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
        let connector = Connector::new(Some(ConnectorOptions {
            ca_file: config
                .upstream_ca_file
                .as_ref()
                .map(|p| p.display().to_string()),
            ..ConnectorOptions::new(UPSTREAM_POOL)
        }));
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
            policy: Mutex::new(policy),
            admission: Admission::default(),
            metrics,
            connector,
            parse_slots: tokio::sync::Semaphore::new(
                std::thread::available_parallelism().map_or(1, |n| n.get()),
            ),
            drain: Default::default(),
            certificate,
        };
        gateway.sync_policy_members();
        Ok(gateway)
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
            Some(path) => config::load_file(path).and_then(|c| self.apply(c)),
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
        self.policy
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .set_config(config.policy.clone());
        *self.current.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(Snapshot {
            config,
            replicas,
            tokenizers,
            classes,
            tenants,
        });
        drop(joined);
        self.sync_policy_members();
        tracing::info!("configuration reloaded");
        Ok(())
    }

    /// Milliseconds since the gateway started.
    pub fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// The token agents must present, when agent reports are on.
    pub fn agent_token(&self) -> Option<String> {
        self.tokens
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .agent
            .clone()
    }

    /// The token the admin API asks for, when it has one.
    pub fn admin_token(&self) -> Option<String> {
        self.tokens
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .admin
            .clone()
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
        self.sync_policy_members();
        tracing::info!(replica = %report.replica, url = %report.url, "replica joined by reporting");
        joined_replica.ok_or_else(|| ApiError::new(ErrorKind::Internal, "joined replica vanished"))
    }

    /// Forgets what the policy learnt about a replica's cache (its worker restarted).
    pub fn forget(&self, replica: &Replica) {
        self.policy
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .forget(replica.slot);
    }

    /// Applies the KV events a replica's agent relayed to the precise prefix index.
    pub fn apply_kv(&self, replica: &Replica, update: &KvUpdate) -> Applied {
        self.policy
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .apply_kv(replica.slot, update)
    }

    fn sync_policy_members(&self) {
        let snap = self.snapshot();
        let members: Vec<(ReplicaId, &str)> = snap
            .replicas
            .iter()
            .map(|r| (r.slot, r.name.as_str()))
            .collect();
        self.policy
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .set_members(&members);
    }

    /// Ranks the replicas for a request on `model`. The top one is counted in flight before
    /// the policy lock is released, so concurrent decisions see each other.
    pub fn route(
        &self,
        snap: &Snapshot,
        model: &str,
        features: &RequestFeatures,
        class: Option<&Class>,
    ) -> Result<Route, ApiError> {
        self.route_top(snap, model, features, class, None)
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
        let has_room = |model: &str, class: &Class| self.has_room(&self.snapshot(), model, class);
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

    /// Whether some replica of `class`'s pool that serves `model` has room: below its
    /// in-flight cap, and below the KV and queue saturation its agent reports. An unknown
    /// model "has room", so that routing reports it.
    fn has_room(&self, snap: &Snapshot, model: &str, class: &Class) -> bool {
        let Ok(serving) = candidates(snap, model, Some(class)) else {
            return true;
        };
        let agents = snap.config.agents.as_ref();
        let policy = &snap.config.policy;
        serving.iter().any(|(r, _)| {
            r.is_routable(agents)
                && r.config.max_in_flight.is_none_or(|cap| r.in_flight() < cap)
                && r.reported_kv_usage()
                    .is_none_or(|u| u < policy.kv_saturation)
                && r.reported_waiting() < policy.queue_saturation
        })
    }

    /// [`Gateway::route`] ranking `top` replicas (default: as many as a request may try).
    fn route_top(
        &self,
        snap: &Snapshot,
        model: &str,
        features: &RequestFeatures,
        class: Option<&Class>,
        top: Option<usize>,
    ) -> Result<Route, ApiError> {
        let serving = candidates(snap, model, class)?;
        let agents = snap.config.agents.as_ref();
        let views: Vec<ReplicaView> = serving
            .iter()
            .map(|&(r, adapter_fit)| ReplicaView {
                id: r.slot,
                healthy: r.is_routable(agents),
                in_flight: r.in_flight(),
                max_in_flight: r.config.max_in_flight,
                waiting: r.reported_waiting(),
                prefill_backlog: r.prefill_backlog(),
                stale: r.freshness(agents) == Freshness::Stale,
                kv_usage: r.reported_kv_usage(),
                adapter_fit,
            })
            .collect();
        let started = Instant::now();
        let mut policy = self.policy.lock().unwrap_or_else(PoisonError::into_inner);
        // Only the replicas a request may be tried on need ranking.
        let attempts = snap.config.retries.attempts.max(1) as usize;
        let Decision { ranked, load_bound } = policy.select_top(
            features,
            FleetView { replicas: &views },
            top.unwrap_or(attempts),
        );
        let Some(top) = ranked.first() else {
            drop(policy);
            return Err(ApiError::new(
                ErrorKind::Unavailable,
                format!("no healthy replica serves model `{model}`"),
            ));
        };
        let by_slot = |slot: ReplicaId| {
            serving
                .iter()
                .find(|(r, _)| r.slot == slot)
                .map(|(r, _)| Arc::clone(r))
        };
        let first = by_slot(top.replica)
            .map(|r| InFlight::new(r, Arc::clone(&self.admission.released), top.prefill_tokens));
        policy.record_choice(top, features);
        drop(policy);
        self.metrics
            .decision
            .observe(started.elapsed().as_secs_f64());
        let first =
            first.ok_or_else(|| ApiError::new(ErrorKind::Internal, "ranked an unknown replica"))?;
        let ranked = ranked
            .into_iter()
            .filter_map(|c| by_slot(c.replica).map(|r| (r, c)))
            .collect();
        Ok(Route {
            ranked,
            first,
            load_bound,
        })
    }

    /// Records that a retry sent the request's prefix to another ranked replica.
    pub fn record_prefix(&self, choice: &Candidate, features: &RequestFeatures) {
        self.policy
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .record_choice(choice, features);
    }

    /// Explains a decision without sending anything (admin API).
    pub fn explain(
        &self,
        model: &str,
        features: &RequestFeatures,
        class: Option<&Class>,
    ) -> Result<serde_json::Value, ApiError> {
        let snap = self.snapshot();
        let route = self.route_top(&snap, model, features, class, Some(usize::MAX))?;
        // Explaining must not count as load.
        drop(route.first);
        let candidates: Vec<serde_json::Value> = route
            .ranked
            .iter()
            .map(|(r, c)| serde_json::json!({ "replica": r.name, "score": c }))
            .collect();
        Ok(
            serde_json::json!({ "model": model, "load_bound": route.load_bound, "candidates": candidates }),
        )
    }
}

/// The replicas that may serve `model`, each with its adapter fit (see [`AdapterStatus::fit`];
/// 0 unless `model` names an adapter). A model may name a LoRA adapter: replicas where it is
/// resident serve it, and so may any replica with adapter slots (it loads the adapter,
/// evicting another if full), which also covers an adapter resident nowhere yet. Otherwise the
/// replicas that list the model serve it, else those whose models are not known yet.
fn candidates<'a>(
    snap: &'a Snapshot,
    model: &str,
    class: Option<&Class>,
) -> Result<Vec<(&'a Arc<Replica>, f64)>, ApiError> {
    let all: Vec<(&Arc<Replica>, ModelMatch, Option<AdapterStatus>)> = snap
        .replicas
        .iter()
        .filter(|r| class.is_none_or(|c| c.admits(&r.config.labels)))
        .map(|r| (r, r.may_serve(model), r.adapter_status(model)))
        .collect();
    let capable = |a: &Option<AdapterStatus>| a.is_some_and(|a| a.slots_free.is_some());
    let listed = all.iter().any(|(_, m, _)| *m == ModelMatch::Yes);
    let names_adapter = all.iter().any(|(_, _, a)| a.is_some_and(|a| a.resident))
        || (!listed && all.iter().any(|(_, _, a)| capable(a)));
    let fit = |a: &Option<AdapterStatus>| match a {
        Some(a) if names_adapter => a.fit(),
        _ => 0.0,
    };
    let keep = |m: ModelMatch, a: &Option<AdapterStatus>| {
        if names_adapter {
            m == ModelMatch::Yes || capable(a)
        } else if listed {
            m == ModelMatch::Yes
        } else {
            m == ModelMatch::Unknown
        }
    };
    let serving: Vec<(&'a Arc<Replica>, f64)> = all
        .iter()
        .filter(|(_, m, a)| keep(*m, a))
        .map(|(r, _, a)| (*r, fit(a)))
        .collect();
    if serving.is_empty() {
        if let Some(c) = class.filter(|c| !c.pool.is_empty()) {
            return Err(ApiError::new(
                ErrorKind::ModelNotFound,
                format!(
                    "model `{model}` is not served by any replica in the pool of class `{}` ({:?})",
                    c.name, c.pool
                ),
            )
            .with_param("model"));
        }
        return Err(ApiError::new(
            ErrorKind::ModelNotFound,
            format!("model `{model}` is not served by any replica"),
        )
        .with_param("model"));
    }
    Ok(serving)
}

/// Idle connections kept per upstream (Pingora's default).
const UPSTREAM_POOL: usize = 128;
