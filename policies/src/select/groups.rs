//! Prefix groups (a prompt's first `ring_key_chunks` blocks): which replicas hold one, whether
//! it is hot, whether it is new, where new groups were placed, and how a new one is placed
//! where other gateways route unseen.

use super::Policy;
use crate::{FleetView, ReplicaId, RequestFeatures, Signal, Weights};

impl Policy {
    /// The prompt's prefix group: the hash of its first `ring_key_chunks` blocks (or chunks),
    /// and how many that is; `None` for a prompt shorter than one.
    pub(super) fn group(&self, features: &RequestFeatures) -> Option<(u64, usize)> {
        let leading = if features.block_hashes.is_empty() {
            &features.prefix_chunks
        } else {
            &features.block_hashes
        };
        let n = leading.len().min(self.config.ring_key_chunks.max(1));
        let key = *leading.get(n.checked_sub(1)?)?;
        Some((key, n))
    }

    /// The replicas holding the prompt's group (its key), out of the healthy ones, and the
    /// least any of them holds of the prompt: what all of them have. `None` when none holds it.
    /// `matched` counts, in token mode, a block where events show it and where the latest
    /// decision sent it, not on every replica sent it since: those have not computed it yet,
    /// and counted as holders they would make a busy group look well served, so that it
    /// spreads later.
    pub(super) fn group_holders(
        &self,
        features: &RequestFeatures,
        matched: &[f64],
        fleet: FleetView<'_>,
    ) -> Option<GroupHolders> {
        let (group, n) = self.group(features)?;
        let (healthy, holders, least) = fleet
            .replicas
            .iter()
            .filter(|r| r.healthy)
            .map(|r| matched[r.id.0 as usize])
            .fold((0u32, 0u32, f64::INFINITY), |(h, n_held, least), m| {
                if m >= n as f64 {
                    (h + 1, n_held + 1, least.min(m))
                } else {
                    (h + 1, n_held, least)
                }
            });
        (holders > 0).then_some(GroupHolders {
            group,
            holders,
            healthy,
            least,
        })
    }

    /// Whether the group brings more recent traffic than its holders can take at
    /// `hot_group_factor` times their fair share, or is all the traffic counted yet while more
    /// than one replica lacks it. Recomputing what they all hold elsewhere is then a one-time
    /// cost for a lasting spread, so the prefill and prefix signals count it as held
    /// everywhere and the recompute penalty is lifted.
    pub(super) fn is_hot(&self, g: &GroupHolders, now_ms: u64) -> bool {
        let c = &self.config;
        let half_life = c.traffic_half_life_ms;
        // The holders' part of the traffic, and the group's count out of `n` requests, as this
        // gateway counts them (its own and its peers'). Gateways it does not hear from send
        // `scale` times as many in all: the request being placed, and the margin of one
        // request below, are `1 / scale` of what it counts.
        let part = c.hot_group_factor * f64::from(g.holders) / f64::from(g.healthy);
        let count = self.groups.of(g.group, now_ms, half_life);
        let total = self.traffic.total(now_ms, half_life);
        // The first requests of one system prompt: no other group wants the replicas that lack
        // it, so it spreads from its second request, not once the margin below lets it (a
        // dozen requests queued on its first replica's cold prefill while the rest idle). All
        // but one replica: another group may yet come, and should find one not computing this
        // one (two groups on two replicas). Both counts decay alike, so "all" is equality up
        // to rounding.
        let all_the_traffic = count > 0.0 && count >= total * (1.0 - 1e-9);
        if all_the_traffic && part < 1.0 && g.holders + 1 < g.healthy {
            return true;
        }
        let scale = self.fleet_count(1.0);
        let n = total + 1.0 / scale;
        let share = part * n;
        // More than their share by more than the count's noise, three standard deviations of
        // a binomial count (of n requests, each of the group with chance `part`), and by one of
        // the fleet's requests: a few early requests of one group are not a trend, but a group
        // that is nearly all the traffic shows it soon, the sooner the more gateways send it
        // unseen.
        let noise = 3.0 * (share * (1.0 - part).max(0.0)).sqrt();
        count > share + noise + 1.0 / scale
    }

    /// Whether the group recurs enough for a copy of it on each healthy replica to be used
    /// again: its recent requests are at least as many as the replicas. Only then does a
    /// short recompute earn `recompute_penalty_full_at`'s lighter penalty; a copy of a group
    /// seen once or twice is a recompute and nothing more.
    pub(super) fn recurs(&self, g: &GroupHolders, now_ms: u64) -> bool {
        self.group_recurs(g.group, g.healthy, now_ms)
    }

    /// [`Policy::recurs`] for `group` on a fleet of `healthy` replicas.
    pub(super) fn group_recurs(&self, group: u64, healthy: u32, now_ms: u64) -> bool {
        let own = self
            .groups
            .of(group, now_ms, self.config.traffic_half_life_ms);
        self.fleet_count(own) >= f64::from(healthy)
    }

    /// The fleet's recent requests estimated from those this gateway counted (its own and its
    /// peers'): the gateways it does not hear from send their part too.
    fn fleet_count(&self, counted: f64) -> f64 {
        counted * f64::from(self.gateways) / f64::from(self.seen_gateways)
    }

    /// The weights for a prompt no replica holds any of, where other gateways route unseen
    /// (`None` where none do). Each gateway's spread signal counts its own placements and its
    /// prefill signal its own backlog, so each would place a new prefix elsewhere, and each
    /// copy computes again what the prompts share. The ring's owner, which they all agree on,
    /// gets a vote worth that shared part: `s / (1 + s)` of the prefill signal's weight, `s`
    /// the share of a prompt that the prompts sent lately found held (1 before any was). On
    /// an idle fleet it keeps the owner with up to `2 s` prompts queued there. The spread gets
    /// none.
    pub(super) fn unseen_cold_weights(&self, w: &Weights, now_ms: u64) -> Option<Weights> {
        (self.gateways > self.seen_gateways).then(|| {
            let shared = self
                .shared_share
                .at(now_ms, self.config.traffic_half_life_ms)
                .unwrap_or(1.0)
                .clamp(0.0, 1.0);
            let mut agreed = w.clone();
            agreed.0[Signal::Ring] =
                w.0[Signal::Ring].max(w.0[Signal::Prefill] * shared / (1.0 + shared));
            agreed.0[Signal::Spread] = 0.0;
            agreed
        })
    }

    /// Whether no request of `group` was routed recently (see [`counts_as_new`]).
    pub(super) fn is_new(&self, group: u64, now_ms: u64) -> bool {
        counts_as_new(
            self.groups
                .of(group, now_ms, self.config.traffic_half_life_ms),
        )
    }

    /// For a prompt of a new group that no replica holds any of (`cold`), the spread signal
    /// of each replica: the blocks of new groups it placed recently against its fair share.
    pub(super) fn spread(
        &self,
        features: &RequestFeatures,
        cold: bool,
        healthy: u32,
    ) -> impl Fn(ReplicaId) -> f64 + '_ {
        let now = features.now_ms;
        let half_life = self.config.traffic_half_life_ms;
        let counted = cold
            && self
                .group(features)
                .is_none_or(|(g, _)| self.is_new(g, now));
        let fair = (self.placed.total(now, half_life) + 1.0) / f64::from(healthy.max(1));
        move |id| {
            if counted {
                (1.0 - self.placed.of(id.0 as usize, now, half_life) / (2.0 * fair)).max(0.0)
            } else {
                0.0
            }
        }
    }
}

/// Whether a group with this decayed count of recent requests is new: under half a request.
pub(super) fn counts_as_new(count: f64) -> bool {
    count < 0.5
}

/// The replicas holding a prompt's group: see `Policy::group_holders`.
pub(super) struct GroupHolders {
    group: u64,
    holders: u32,
    healthy: u32,
    /// The least any holder holds of the prompt: what all of them have.
    pub(super) least: f64,
}
