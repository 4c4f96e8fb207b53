//! Bounded-load caps: how many requests a replica may have in flight before prefix and session
//! stickiness yield to the rest of the fleet.

use crate::{PolicyConfig, ReplicaView};

/// What one pass over the healthy replicas tells the caps and the load signal.
pub(crate) struct FleetLoad {
    pub healthy: u32,
    pub in_flight: u64,
    /// The fewest requests any healthy replica has in flight.
    pub idlest: u32,
    /// The most any has in flight plus queued.
    pub busiest: u32,
    /// The fewest prompt blocks (or chunks) any healthy replica holds.
    pub least_held: f64,
}

impl FleetLoad {
    /// `held`: prompt blocks held, by replica slot.
    pub fn of<'r>(replicas: impl Iterator<Item = &'r ReplicaView>, held: &[f64]) -> Self {
        let empty = FleetLoad {
            healthy: 0,
            in_flight: 0,
            idlest: u32::MAX,
            busiest: 0,
            least_held: f64::INFINITY,
        };
        replicas
            .filter(|r| r.healthy)
            .fold(empty, |f, r| FleetLoad {
                healthy: f.healthy + 1,
                in_flight: f.in_flight + u64::from(r.in_flight),
                idlest: f.idlest.min(r.in_flight),
                busiest: f.busiest.max(r.in_flight.saturating_add(r.waiting)),
                least_held: f.least_held.min(held[r.id.0 as usize]),
            })
    }
}

/// The caps of one decision.
pub(crate) struct LoadCaps<'a> {
    config: &'a PolicyConfig,
    /// Requests in flight on the healthy replicas, counting the one being placed.
    total: f64,
    healthy: f64,
    /// Prompt blocks (or chunks) each slot holds, the fewest any healthy replica holds, and
    /// the prompt's length in the same unit.
    held: &'a [f64],
    least_held: f64,
    blocks: f64,
    /// `imbalance_factor` times the idlest replica's in flight plus one.
    imbalance: u32,
    /// The cap for cold placement.
    pub bound: u32,
}

impl<'a> LoadCaps<'a> {
    /// `held` by replica slot, `blocks` the prompt's length.
    pub fn new(
        config: &'a PolicyConfig,
        fleet: &FleetLoad,
        held: &'a [f64],
        blocks: usize,
    ) -> Self {
        let imbalance = if config.imbalance_factor > 0.0 && fleet.healthy > 0 {
            let cap = (config.imbalance_factor * f64::from(fleet.idlest.saturating_add(1))).ceil();
            (cap as u32).max(1)
        } else {
            u32::MAX
        };
        let mut caps = LoadCaps {
            config,
            total: (fleet.in_flight + 1) as f64,
            healthy: f64::from(fleet.healthy.max(1)),
            held,
            least_held: fleet.least_held,
            blocks: blocks.max(1) as f64,
            imbalance,
            bound: 0,
        };
        caps.bound = caps.with_factor(config.load_factor);
        caps
    }

    /// The imbalance guard: no replica takes more, whatever it holds (`u32::MAX` when off).
    pub fn guard(&self) -> u32 {
        self.imbalance
    }

    /// `ceil(factor * total / healthy)`, at least 1, and never over the imbalance cap.
    fn with_factor(&self, factor: f64) -> u32 {
        let cap = ((factor * self.total) / self.healthy).ceil() as u32;
        cap.max(1).min(self.imbalance)
    }

    /// A replica's cap: the cold bound, raised by `cached_load_bonus` for the share of the
    /// prompt it holds beyond the least-holding replica (a spill would prefill that share).
    pub fn of(&self, r: &ReplicaView) -> u32 {
        let c = self.config;
        let extra = (self.held[r.id.0 as usize] - self.least_held) / self.blocks;
        if c.cached_load_bonus > 0.0 && extra > 0.0 {
            self.with_factor(c.load_factor + c.cached_load_bonus * extra)
        } else {
            self.bound
        }
    }
}
