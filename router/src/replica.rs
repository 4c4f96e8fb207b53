//! One upstream replica as the gateway connects to it: its name, slot, settings and address.
//! Its live state (health, ejection, requests in flight, its agent's reports, the scores of its
//! last decision) is kept in the gateway's [`kvgate_policies::FleetState`] under its slot.

use crate::config::{ReplicaConfig, Upstream};
use kvgate_policies::{ReplicaId, ReplicaSpec};
use pingora_core::upstreams::peer::HttpPeer;
use std::time::Duration;

pub struct Replica {
    pub name: String,
    pub slot: ReplicaId,
    pub config: ReplicaConfig,
    pub upstream: Upstream,
}

impl Replica {
    pub fn new(slot: ReplicaId, config: ReplicaConfig, upstream: Upstream) -> Self {
        Replica {
            name: config.name().to_string(),
            slot,
            config,
            upstream,
        }
    }

    /// Where to connect: TLS for an `https://` replica, its certificate checked for its host.
    pub fn peer(&self, connect: Duration, pool_idle: Option<Duration>) -> HttpPeer {
        crate::client::http_peer(&self.upstream, connect, pool_idle)
    }

    /// What the fleet state knows of it from its settings.
    pub fn spec(&self) -> ReplicaSpec {
        ReplicaSpec {
            name: self.name.clone(),
            url: self.config.url.clone(),
            models: self.config.models.clone(),
            labels: self.config.labels.clone(),
            max_in_flight: self.config.max_in_flight,
        }
    }

    /// Its models are learnt (from `/v1/models` or its agent), not configured.
    pub fn needs_discovery(&self) -> bool {
        self.config.models.is_empty()
    }
}
