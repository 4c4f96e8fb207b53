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
    /// The floor under every cap: this gateway's share of `min_load_cap`.
    min_cap: u32,
    /// The imbalance guard (see [`LoadCaps::guard`]).
    imbalance: u32,
    /// The cap for cold placement.
    pub bound: u32,
}

impl<'a> LoadCaps<'a> {
    /// `held` by replica slot, `blocks` the prompt's length; `gateways` share the fleet (each
    /// counts only its own requests, so each floors its caps at its share of `min_load_cap`).
    pub fn new(
        config: &'a PolicyConfig,
        fleet: &FleetLoad,
        held: &'a [f64],
        blocks: usize,
        gateways: u32,
    ) -> Self {
        let mut caps = LoadCaps {
            config,
            total: (fleet.in_flight + 1) as f64,
            healthy: f64::from(fleet.healthy.max(1)),
            held,
            least_held: fleet.least_held,
            blocks: blocks.max(1) as f64,
            min_cap: config.min_load_cap.div_ceil(gateways.max(1)),
            imbalance: u32::MAX,
            bound: 0,
        };
        caps.bound = caps.with_factor(config.load_factor);
        if config.imbalance_factor > 0.0 && fleet.healthy > 0 {
            // Never under the cap of a replica holding the whole prompt: when one replica has
            // just drained (idlest 0 or 1 after a burst), `imbalance_factor * (idlest + 1)`
            // is under the fleet's fair share, and every home would spill its group (a full
            // prefill each) to it.
            let idle = (config.imbalance_factor * f64::from(fleet.idlest.saturating_add(1))).ceil();
            let holder = caps.with_factor(config.load_factor + config.cached_load_bonus);
            caps.imbalance = (idle as u32).max(holder);
        }
        caps
    }

    /// The imbalance guard: no replica takes more, whatever it holds (`u32::MAX` when off):
    /// `imbalance_factor` times the idlest replica's in flight plus one, or a whole-prompt
    /// holder's cap if that is higher.
    pub fn guard(&self) -> u32 {
        self.imbalance
    }

    /// `u32::MAX` while the caps are off (`load_factor` 0), else
    /// `ceil(factor * total / healthy)`, at least this gateway's share of `min_load_cap` and
    /// 1 (never over the guard, which is at least a whole-prompt holder's cap).
    fn with_factor(&self, factor: f64) -> u32 {
        if self.config.load_factor == 0.0 {
            return u32::MAX;
        }
        let cap = ((factor * self.total) / self.healthy).ceil() as u32;
        cap.max(self.min_cap).max(1)
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
