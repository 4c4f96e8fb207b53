//! A snapshot: one consistent view of the config and what is built from it (replicas, token
//! modes, classes, tenants, tokens), rebuilt on reload from the new config and the old
//! snapshot, whose unchanged parts keep their state.

use crate::classes::Classes;
use crate::config::{self, ConfigError, GatewayConfig};
use crate::replica::Replica;
use crate::tenants::Tenants;
use crate::tokenizers::TokenModes;
use kvgate_policies::ReplicaId;
use std::collections::BTreeSet;
use std::sync::Arc;

/// One consistent view of config and replicas.
pub struct Snapshot {
    pub config: GatewayConfig,
    pub replicas: Vec<Arc<Replica>>,
    /// Models routed in token mode.
    pub tokenizers: TokenModes,
    /// SLA classes, when configured.
    pub classes: Option<Classes>,
    /// Tenants, when configured: then every request needs one of their keys.
    pub tenants: Option<Tenants>,
}

pub(crate) fn build_classes(config: &GatewayConfig) -> Result<Option<Classes>, Vec<ConfigError>> {
    let Some(sla) = &config.sla else {
        return Ok(None);
    };
    Classes::build(sla, &config.policy)
        .map(Some)
        .map_err(|problems| {
            problems
                .into_iter()
                .map(|(path, message)| ConfigError {
                    path: format!("sla.{path}"),
                    line: None,
                    message,
                })
                .collect()
        })
}

pub(crate) fn config_error(path: &str, message: String) -> Vec<ConfigError> {
    vec![ConfigError {
        path: path.into(),
        line: None,
        message,
    }]
}

/// Whether two replica URLs name one server.
pub(crate) fn same_server(a: &str, b: &str) -> bool {
    match (config::resolve_url(a), config::resolve_url(b)) {
        (Ok(a), Ok(b)) => a.addr == b.addr,
        _ => a.trim_end_matches('/') == b.trim_end_matches('/'),
    }
}

pub(crate) fn build_tenants(config: &GatewayConfig, old: Option<&Tenants>) -> Option<Tenants> {
    (!config.tenants.is_empty()).then(|| Tenants::build(&config.tenants, old))
}

/// Bearer tokens the gateway asks for.
pub(crate) struct Tokens {
    pub agent: Option<String>,
    pub admin: Option<String>,
    pub peer: Option<String>,
}

pub(crate) fn read_tokens(config: &GatewayConfig) -> Result<Tokens, Vec<ConfigError>> {
    let read = |file: Option<&std::path::Path>, path: &str| {
        file.map(config::read_token).transpose().map_err(|message| {
            vec![ConfigError {
                path: path.into(),
                line: None,
                message,
            }]
        })
    };
    Ok(Tokens {
        agent: read(
            config.agents.as_ref().map(|a| a.token_file.as_path()),
            "agents.token_file",
        )?,
        admin: read(config.admin_token_file.as_deref(), "admin_token_file")?,
        peer: read(
            config.peers.as_ref().map(|p| p.token_file.as_path()),
            "peers.token_file",
        )?,
    })
}

/// The configured replicas, then those that joined by reporting (unless now configured),
/// reusing `old` ones (state and slot) whose settings are unchanged, and keeping the slot of a
/// renamed-in-place replica's name.
pub(crate) fn build_replicas(
    config: &GatewayConfig,
    joined: &[config::ReplicaConfig],
    old: &[Arc<Replica>],
) -> Result<Vec<Arc<Replica>>, Vec<ConfigError>> {
    let all: Vec<&config::ReplicaConfig> = config
        .replicas
        .iter()
        .chain(joined.iter().filter(|j| {
            !config
                .replicas
                .iter()
                .any(|c| c.name() == j.name() || c.url == j.url)
        }))
        .collect();
    let mut used: BTreeSet<u32> = BTreeSet::new();
    let mut slots = Vec::with_capacity(all.len());
    for rc in &all {
        let slot = old.iter().find(|r| r.name == rc.name()).map(|r| r.slot.0);
        if let Some(s) = slot {
            used.insert(s);
        }
        slots.push(slot);
    }
    let mut next_free = 0u32;
    let mut replicas = Vec::with_capacity(all.len());
    for (i, (rc, slot)) in all.into_iter().zip(slots).enumerate() {
        if let Some(existing) = old.iter().find(|r| r.name == rc.name() && r.config == *rc) {
            replicas.push(Arc::clone(existing));
            continue;
        }
        let slot = slot.unwrap_or_else(|| {
            while used.contains(&next_free) {
                next_free += 1;
            }
            used.insert(next_free);
            next_free
        });
        let upstream = config::resolve_url(&rc.url).map_err(|message| {
            vec![ConfigError {
                path: format!("replicas[{i}].url"),
                line: None,
                message,
            }]
        })?;
        replicas.push(Arc::new(Replica::new(
            ReplicaId(slot),
            rc.clone(),
            upstream,
        )));
    }
    Ok(replicas)
}
