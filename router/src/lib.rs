//! The kvgate gateway: an OpenAI-compatible reverse proxy on Pingora that ranks replicas with
//! `kvgate-policies` and forwards each request's original bytes to the best one.

mod admin;
mod admission;
mod agents;
mod bearer;
mod classes;
mod client;
pub mod config;
mod connections;
mod drain;
mod gateway;
mod health;
mod idle_pool;
mod in_flight;
mod metrics;
mod peers;
mod proxy;
mod replica;
mod snapshot;
mod tenants;
mod tls;
mod tokenizers;
mod upstream_connectors;

pub use config::{ConfigError, GatewayConfig};
pub use connections::raise_open_file_limit;
pub use gateway::Gateway;
pub use tenants::hash_api_key;

use pingora_core::server::configuration::ServerConf;
use pingora_core::server::{RunArgs, Server};
use pingora_core::services::background::background_service;
use pingora_core::services::listening::Service;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// Errors that stop the gateway from starting.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("invalid configuration:\n{}", .0.iter().map(|e| format!("  {e}")).collect::<Vec<_>>().join("\n"))]
    Config(Vec<ConfigError>),
    #[error("cannot listen on {addr} ({what}): {error}")]
    Listen {
        what: &'static str,
        addr: String,
        error: std::io::Error,
    },
}

/// Fails at once on an address that cannot be listened on (taken, say): Pingora would log it
/// and run on without that listener.
fn check_listen(what: &'static str, addr: &str) -> Result<(), StartError> {
    std::net::TcpListener::bind(addr)
        .map(drop)
        .map_err(|error| StartError::Listen {
            what,
            addr: addr.to_string(),
            error,
        })
}

/// Validates a config file, its tokenizers too: every error, or the config and its warnings.
pub fn check_config(path: &Path) -> Result<config::Loaded, Vec<ConfigError>> {
    let loaded = config::load_file(path)?;
    tokenizers::load(&loaded.config, &Default::default())?;
    Ok(loaded)
}

/// How the gateway starts.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Overrides the config's `listen`.
    pub listen: Option<String>,
    /// Take the listening sockets of a running gateway with the same listeners, which hands
    /// them over on SIGQUIT and drains (Pingora's graceful upgrade).
    pub upgrade: bool,
    /// Called just before the process exits after a stop (Pingora ends it with
    /// `process::exit`, which runs no destructors): flushes what the caller buffers.
    pub before_exit: Option<fn()>,
}

/// Runs the gateway until the process is signalled (SIGINT: fast; SIGTERM: drain, see
/// [`drain`]; SIGQUIT: hand the listeners to an upgrading process, then drain; SIGHUP: reload
/// the config file). Never returns on success.
pub fn run(path: &Path, options: RunOptions) -> Result<(), StartError> {
    let mut config = config::load_file_warning(path).map_err(StartError::Config)?;
    if let Some(addr) = options.listen {
        config.listen = config::Listen::One(addr);
    }
    let (threads, listen, admin) = (
        config.threads,
        config.listen.clone(),
        config.admin_listen.clone(),
    );
    // An upgrading process takes sockets the old one holds.
    if !options.upgrade {
        for addr in listen.addresses() {
            check_listen("listen", addr)?;
        }
        if let Some(addr) = &admin {
            check_listen("admin_listen", addr)?;
        }
    }
    let grace = Duration::from_millis(config.shutdown_grace_ms);
    let upgrade_sock = upgrade_sock(&config);
    let gateway =
        Arc::new(Gateway::new(config, Some(path.to_path_buf())).map_err(StartError::Config)?);

    let conf = ServerConf {
        threads,
        work_stealing: false,
        // Pingora ends every task once this is over: the drain's own deadline comes first, so
        // that streams still running get their error event.
        grace_period_seconds: Some(grace.as_secs() + 2),
        graceful_shutdown_timeout_seconds: Some(5),
        upgrade_sock,
        pid_file: format!("/tmp/kvgate-{}.pid", std::process::id()),
        ..ServerConf::default()
    };
    let opt = pingora_core::server::configuration::Opt {
        upgrade: options.upgrade,
        ..Default::default()
    };
    let mut server = Server::new_with_opt_and_conf(Some(opt), conf);
    server.bootstrap();
    let mut proxy = Service::new(
        "kvgate proxy".into(),
        proxy::ProxyService::new(Arc::clone(&gateway), threads),
    );
    let tls = |certificate: &Arc<tls::Certificate>| {
        certificate.settings().map_err(|message| {
            StartError::Config(vec![ConfigError {
                path: "tls".into(),
                line: None,
                message,
            }])
        })
    };
    for addr in listen.addresses() {
        match &gateway.certificate {
            Some(c) => proxy.add_tls_with_settings(addr, None, tls(c)?),
            None => proxy.add_tcp(addr),
        }
    }
    server.add_service(proxy);
    if let Some(addr) = admin {
        let mut admin = Service::new(
            "kvgate admin".into(),
            admin::AdminApp::new(Arc::clone(&gateway)),
        );
        let admin_tls = gateway
            .snapshot()
            .config
            .tls
            .as_ref()
            .is_some_and(|t| t.admin);
        match &gateway.certificate {
            Some(c) if admin_tls => admin.add_tls_with_settings(&addr, None, tls(c)?),
            _ => admin.add_tcp(&addr),
        }
        server.add_service(admin);
    }
    server.add_service(background_service(
        "health checks",
        health::HealthChecker {
            gateway: Arc::clone(&gateway),
        },
    ));
    server.add_service(background_service(
        "decisions to peer gateways",
        peers::Pusher {
            gateway: Arc::clone(&gateway),
        },
    ));
    server.add_service(background_service(
        "reload on SIGHUP",
        health::ReloadOnSignal {
            gateway: Arc::clone(&gateway),
        },
    ));
    server.add_service(background_service(
        "exit when drained",
        drain::ExitWhenIdle {
            gateway: Arc::clone(&gateway),
            before_exit: options.before_exit,
        },
    ));
    tracing::info!(listen = ?listen.addresses(), upgrade = options.upgrade, "kvgate gateway starting");
    server.run(RunArgs {
        shutdown_signal: Box::new(drain::Signals { gateway, grace }),
    });
    if let Some(flush) = options.before_exit {
        flush();
    }
    std::process::exit(0)
}

/// Where a gateway hands its sockets to an upgrading one: the same path for every process
/// with the same listeners.
fn upgrade_sock(config: &GatewayConfig) -> String {
    let mut addresses: Vec<&str> = config
        .listen
        .addresses()
        .iter()
        .map(String::as_str)
        .collect();
    addresses.extend(config.admin_listen.as_deref());
    let key = xxhash_rust::xxh3::xxh3_64(addresses.join(",").as_bytes());
    format!("/tmp/kvgate-upgrade-{key:016x}.sock")
}
