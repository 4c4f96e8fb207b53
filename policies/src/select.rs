//! Selection: filter, score, rank.

use crate::live_histories::LiveHistories;
use crate::load_cap::{FleetLoad, LoadCaps};
use crate::prefill::PromptWork;
use crate::sessions::SessionTable;
use crate::signal::BySignal;
use crate::traffic::{GroupTraffic, RecentMean, RecentTraffic};
use crate::{
    Applied, ApproxPrefixIndex, FleetView, HashRing, PolicyConfig, PreciseIndex, ReplicaId,
    ReplicaView, RequestFeatures, Signal, TierValues,
};
use kvgate_protocol::telemetry::KvUpdate;
use serde::Serialize;

pub use candidate::Candidate;

/// Prefix groups whose recent traffic is counted (the least recently routed are forgotten).
const GROUPS_COUNTED: usize = 65_536;

/// A replica's limits in one decision.
#[derive(Debug, Clone, Copy)]
struct Limits {
    /// Its bounded-load cap.
    cap: u32,
    /// At its cap, its reported KV saturation or a hard limit: prefix and session stickiness
    /// yield.
    saturated: bool,
    /// At a hard limit (the imbalance guard, its `max_in_flight`, its agent's reported queue
    /// saturation): the prefill signal yields too.
    full: bool,
}

/// The outcome of one selection: healthy candidates, best first.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Decision {
    pub ranked: Vec<Candidate>,
    /// The bounded-load cap for cold placement in this decision (a replica holding more of the
    /// prompt may have a higher one: [`Candidate::load_cap`]).
    pub load_bound: u32,
    /// The prompt's group was hot (`hot_group_factor`): what every holder has of it counted
    /// as held on every replica with no prefill queued, and no recompute penalty.
    pub hot_group: bool,
    /// The request opened a session (none bound yet): what every holder of its group has
    /// counted as held as for a hot group.
    pub opens_session: bool,
    /// The session's home was past its cache with this turn (`select/session_room.rs`): its
    /// history there counted as gone, and the session signal went to another replica.
    pub session_past_cache: bool,
    /// How many replicas were tied within `tie_margin` (the first of `ranked` was drawn from
    /// them); 1 when none was, 0 with no candidate.
    pub tied: u32,
}

/// The routing policy and the state it learns (prefix indexes, sessions, ring).
#[derive(Debug, Clone)]
pub struct Policy {
    config: PolicyConfig,
    ring: HashRing,
    prefix: ApproxPrefixIndex,
    precise: PreciseIndex,
    sessions: SessionTable,
    traffic: RecentTraffic,
    groups: GroupTraffic,
    /// The blocks of new groups' first requests, per replica: where groups were placed.
    placed: RecentTraffic,
    /// The sessions' own histories live on each replica.
    live: LiveHistories,
    /// Of the prompts sent where some of them was held, the share held: what a prompt
    /// shares with those before it, lately.
    shared_share: RecentMean,
    members: Vec<(ReplicaId, String)>,
    /// Gateways routing to this fleet, this one included, and how many of them this one
    /// sees the decisions of (see [`Policy::set_gateways`]).
    gateways: u32,
    seen_gateways: u32,
}

impl Policy {
    pub fn new(config: PolicyConfig) -> Self {
        let prefix = ApproxPrefixIndex::new(config.prefix_capacity);
        Policy {
            config,
            ring: HashRing::default(),
            prefix,
            precise: PreciseIndex::default(),
            sessions: SessionTable::default(),
            traffic: RecentTraffic::default(),
            groups: GroupTraffic::new(GROUPS_COUNTED),
            placed: RecentTraffic::default(),
            live: LiveHistories::default(),
            shared_share: RecentMean::default(),
            members: Vec::new(),
            gateways: 1,
            seen_gateways: 1,
        }
    }

    pub fn config(&self) -> &PolicyConfig {
        &self.config
    }

    /// Applies new settings; learned prefixes are kept unless the capacity changed.
    pub fn set_config(&mut self, config: PolicyConfig) {
        let rebuild_ring = config.ring_vnodes != self.config.ring_vnodes;
        if config.prefix_capacity != self.config.prefix_capacity
            || config.chunk_bytes != self.config.chunk_bytes
        {
            self.prefix = ApproxPrefixIndex::new(config.prefix_capacity);
        }
        self.config = config;
        if rebuild_ring {
            self.rebuild_ring();
        }
    }

    /// How many gateways route to this fleet, this one included, and how many of them this one
    /// sees the decisions of (itself and its peers). Each counts only its own requests in
    /// flight, so each takes its share of the fleet-wide floor under the caps
    /// (`min_load_cap`); and each counts the recent requests of the gateways it sees, so it
    /// scales those counts by `gateways / seen` to judge the fleet's traffic (a group's heat).
    pub fn set_gateways(&mut self, gateways: u32, seen: u32) {
        self.seen_gateways = seen.max(1);
        self.gateways = gateways.max(self.seen_gateways);
    }

    /// Sets the fleet membership: each replica's slot and its stable name (which places it on
    /// the ring). Slots no longer present lose what the index learned about them.
    pub fn set_members(&mut self, members: &[(ReplicaId, &str)]) {
        for (old, _) in &self.members {
            if !members.iter().any(|(id, _)| id == old) {
                self.prefix.clear_replica(*old);
                self.precise.clear_replica(*old);
                self.sessions.forget_replica(*old);
                let half_life = self.config.traffic_half_life_ms;
                self.traffic.clear(old.0 as usize, half_life);
                self.placed.clear(old.0 as usize, half_life);
                self.live.clear_replica(*old);
            }
        }
        self.members = members
            .iter()
            .map(|&(id, name)| (id, name.to_string()))
            .collect();
        self.rebuild_ring();
    }

    /// Forgets the prefixes a replica was believed to hold (it restarted).
    pub fn forget(&mut self, replica: ReplicaId) {
        self.prefix.clear_replica(replica);
        self.precise.clear_replica(replica);
    }

    /// What blocks in `replica`'s lower tiers are worth against a device block, as its
    /// engine measured.
    pub fn set_tier_values(&mut self, replica: ReplicaId, values: TierValues) {
        self.precise.set_tier_values(replica, values);
    }

    /// Applies the KV events a replica's agent relayed.
    pub fn apply_kv(&mut self, replica: ReplicaId, update: &KvUpdate) -> Applied {
        self.precise.apply(replica, update)
    }

    /// Learns that `replica` was sent this request's prefix (and now serves its session).
    pub fn record(&mut self, replica: ReplicaId, features: &RequestFeatures) {
        self.record_held(replica, 0, features);
    }

    /// [`Policy::record`] for a ranked candidate: in token mode, the blocks the decision found
    /// it holding need no guess.
    pub fn record_choice(&mut self, choice: &Candidate, features: &RequestFeatures) {
        self.record_held(choice.replica, choice.prefix_blocks as usize, features);
    }

    fn record_held(&mut self, replica: ReplicaId, held: usize, features: &RequestFeatures) {
        let half_life = self.config.traffic_half_life_ms;
        self.traffic
            .add(replica.0 as usize, features.now_ms, half_life);
        if let Some((group, _)) = self.group(features) {
            let before = self.groups.add(group, features.now_ms, half_life);
            if groups::counts_as_new(before) {
                let blocks = features
                    .block_hashes
                    .len()
                    .max(features.prefix_chunks.len());
                self.placed.add_n(
                    replica.0 as usize,
                    blocks as f64,
                    features.now_ms,
                    half_life,
                );
            }
        }
        let blocks = features.block_hashes.len();
        if held > 0 && blocks > 0 {
            self.shared_share
                .add(held as f64 / blocks as f64, features.now_ms, half_life);
        }
        let shared = self.shared_part(features);
        if features.block_hashes.is_empty() {
            self.prefix.insert(replica, &features.prefix_chunks);
        } else {
            let expires = features.now_ms + self.config.assumed_ttl_ms;
            let hashes = &features.block_hashes;
            self.precise
                .assume(replica, hashes, held, features.now_ms, expires);
        }
        if let Some(session) = features.session {
            self.bind_session(session, replica, shared, features);
        }
    }

    pub fn prefix_index(&self) -> &ApproxPrefixIndex {
        &self.prefix
    }

    pub fn precise_index(&self) -> &PreciseIndex {
        &self.precise
    }

    fn rebuild_ring(&mut self) {
        self.ring = HashRing::new(
            self.members.iter().map(|(id, name)| (*id, name.as_str())),
            self.config.ring_vnodes,
        );
    }

    /// Ranks the healthy replicas of `fleet` for a request.
    pub fn select(&self, features: &RequestFeatures, fleet: FleetView<'_>) -> Decision {
        self.select_top(features, fleet, usize::MAX)
    }

    /// The prompt's leading blocks (token mode) or chunks (text mode) each replica holds, by
    /// slot; in token mode also the same as a group's heat counts its holders (see
    /// `Policy::group_holders`); and the prompt's length in that unit.
    fn prefix_overlap(
        &self,
        features: &RequestFeatures,
        fleet: FleetView<'_>,
    ) -> (Vec<f64>, Option<Vec<f64>>, usize) {
        let slots = fleet
            .replicas
            .iter()
            .map(|r| r.id.0 as usize + 1)
            .max()
            .unwrap_or_default();
        let mut matched = vec![0.0; slots];
        if features.block_hashes.is_empty() {
            for (id, run) in self.prefix.overlaps(&features.prefix_chunks) {
                if let Some(m) = matched.get_mut(id.0 as usize) {
                    *m = run as f64;
                }
            }
            (matched, None, features.prefix_chunks.len())
        } else {
            let hashes = &features.block_hashes;
            let mut latest = vec![0.0; slots];
            self.precise
                .overlaps_and_latest(hashes, features.now_ms, &mut matched, &mut latest);
            (matched, Some(latest), hashes.len())
        }
    }

    /// Whether a replica carries at most `traffic_bound` times its share of the fleet's
    /// recent traffic (every one does while the bound is off).
    fn within_traffic(&self, now_ms: u64, healthy: u32) -> impl Fn(ReplicaId) -> bool + '_ {
        let c = &self.config;
        let half_life = c.traffic_half_life_ms;
        let total = self.traffic.total(now_ms, half_life);
        let bound = c.traffic_bound * (total + 1.0) / f64::from(healthy.max(1));
        move |id| {
            c.traffic_bound == 0.0 || self.traffic.of(id.0 as usize, now_ms, half_life) <= bound
        }
    }

    /// The best `top` healthy replicas of `fleet` for a request, best first (the same as the
    /// head of [`Policy::select`]'s ranking, for less work in large fleets).
    pub fn select_top(
        &self,
        features: &RequestFeatures,
        fleet: FleetView<'_>,
        top: usize,
    ) -> Decision {
        let (mut matched, heat_matched, blocks) = self.prefix_overlap(features, fleet);
        let mut session_home = features.session.and_then(|s| {
            self.sessions
                .get(s, features.now_ms, self.config.session_ttl_ms)
        });
        let mut session_past_cache = false;
        if let Some(home) = session_home {
            if let Some(to) = self.session_move(features, home, fleet) {
                // Past its cache, the home evicts the history while the turn waits there.
                if let Some(m) = matched.get_mut(home.0 as usize) {
                    *m = 0.0;
                }
                session_home = Some(to);
                session_past_cache = true;
            }
        }
        self.drop_evicted_guesses(features, fleet, blocks, &mut matched);
        let load = FleetLoad::of(fleet.replicas.iter(), &matched);
        if load.healthy == 0 {
            return Decision::default();
        }
        let c = &self.config;
        let caps = LoadCaps::new(c, &load, &matched, blocks, self.gateways);
        let load_bound = caps.bound;
        let limits: Vec<Limits> = fleet
            .replicas
            .iter()
            .map(|r| {
                let full = r.in_flight >= caps.guard()
                    || r.max_in_flight.is_some_and(|m| r.in_flight >= m)
                    || r.waiting >= c.queue_saturation;
                // Not a hard limit: a full cache frees blocks as its requests finish, while a
                // spill recomputes the prompt and evicts another's blocks where it lands, so the
                // prefill signal still counts what the replica holds.
                let kv_full = r.kv_usage.is_some_and(|u| u >= c.kv_saturation);
                let cap = caps.of(r);
                Limits {
                    cap,
                    saturated: full || kv_full || r.in_flight >= cap,
                    full,
                }
            })
            .collect();

        // The least prefill work ahead of the first token on a replica below its hard limits.
        let most_held = fleet
            .replicas
            .iter()
            .zip(&limits)
            .filter(|(r, l)| r.healthy && !l.full)
            .map(|(r, _)| matched[r.id.0 as usize])
            .fold(0.0, f64::max);
        let heat_matched = heat_matched.as_deref().unwrap_or(&matched);
        let group = self.group_holders(features, heat_matched, fleet);
        let hot = group
            .as_ref()
            .is_some_and(|g| self.is_hot(g, features.now_ms));
        // A short recompute costs little only for a group whose copies will be used again.
        let full_at = if c.recompute_penalty_full_at > 0
            && group
                .as_ref()
                .is_some_and(|g| self.recurs(g, features.now_ms))
        {
            c.recompute_penalty_full_at
        } else {
            0
        };
        // A session's own history serves only its next turn: moving it costs that turn alone.
        let penalty = if hot || features.session.is_some() {
            0.0
        } else {
            c.recompute_penalty
        };
        // A session's first request places every turn to come, where its own history will be
        // worth more than a copy of what its group's holders have: like a hot group's, that
        // counts as held (where nothing is queued, below).
        let opens_session = features.session.is_some() && session_home.is_none();
        let shared = group
            .filter(|_| hot || opens_session)
            .map_or(0.0, |g| g.least);
        // Copying the shared blocks is free only where nothing is queued: elsewhere the copy's
        // prefill delays every request behind it, those of the groups the replica holds too.
        let held_or_shared = |r: &ReplicaView, held: f64| {
            if r.prefill_backlog == 0 {
                held.max(shared)
            } else {
                held
            }
        };
        let mut prompt = PromptWork::new(features.prompt_tokens, blocks)
            .with_recompute_penalty(most_held, penalty, full_at);
        if features.session.is_some() {
            prompt = prompt.without_step_wait();
        }
        // Every engine queueing is a fleet short of KV, not one replica: a prompt moved for its
        // wait would only copy its prefix into another full cache.
        if fleet
            .replicas
            .iter()
            .filter(|r| r.healthy)
            .all(|r| r.kv_queue > 0)
        {
            prompt = prompt.without_kv_wait();
        }
        let prompt = prompt.with_fleet_queues(fleet.replicas.iter());
        let least_work = fleet
            .replicas
            .iter()
            .zip(&limits)
            .filter(|(r, l)| r.healthy && !l.full)
            .map(|(r, _)| prompt.ahead_on(r, held_or_shared(r, matched[r.id.0 as usize])))
            .min()
            .unwrap_or_default();

        // Ring order of the candidates, and the bounded-load owner: the first healthy,
        // unsaturated replica clockwise from the key (within its traffic bound, if set).
        let distance: Vec<u64> = fleet
            .replicas
            .iter()
            .map(|r| {
                self.ring
                    .distance(r.id, features.ring_key)
                    .unwrap_or(u64::MAX)
            })
            .collect();
        let within_traffic = self.within_traffic(features.now_ms, load.healthy);
        let owner_among = |traffic_bounded: bool| {
            fleet
                .replicas
                .iter()
                .zip(&distance)
                .zip(&limits)
                .filter(|((r, &d), l)| d != u64::MAX && r.healthy && !l.saturated)
                .filter(|((r, _), _)| !traffic_bounded || within_traffic(r.id))
                .min_by_key(|((r, &d), _)| (d, r.id))
                .map(|((r, _), _)| r.id)
        };
        // Usually the ring's owner is within its traffic bound: one lookup, not one each.
        let owner = match owner_among(false) {
            Some(o) if !within_traffic(o) => owner_among(true).or(Some(o)),
            o => o,
        };

        let w = features.weights.as_ref().unwrap_or(&c.weights);
        let unseen_cold = (most_held <= 0.0)
            .then(|| self.unseen_cold_weights(w, features.now_ms))
            .flatten();
        let w = unseen_cold.as_ref().unwrap_or(w);
        let spread = self.spread(features, most_held <= 0.0, load.healthy);
        let mut ranked: Vec<Candidate> = fleet
            .replicas
            .iter()
            .enumerate()
            .filter(|(_, r)| r.healthy)
            .map(|(i, r)| {
                let Limits {
                    cap: load_cap,
                    saturated: is_saturated,
                    full,
                } = limits[i];
                let held = matched[r.id.0 as usize];
                let mut signals = BySignal::default();
                // A hot group's shared blocks count as held here too.
                signals[Signal::Prefix] = if is_saturated {
                    0.0
                } else {
                    held_or_shared(r, held) / blocks.max(1) as f64
                };
                signals[Signal::Ring] = if owner == Some(r.id) { 1.0 } else { 0.0 };
                signals[Signal::Load] = 1.0
                    - f64::from(r.in_flight.saturating_add(r.waiting))
                        / (f64::from(load.busiest) + 1.0);
                // It weighs load in tokens, so only the hard limits stop it; at its
                // bounded-load cap a holder still has less to compute than the others.
                signals[Signal::Prefill] = if full {
                    0.0
                } else {
                    prompt.relative(least_work, prompt.ahead_on(r, held_or_shared(r, held)))
                };
                signals[Signal::Fresh] = if r.stale { 0.0 } else { 1.0 };
                // Stickiness yields only to saturation, and stands in only for what the prefix
                // index cannot show the home holding: the history it does show is weighed by
                // the prefix and prefill signals, as any cached prefix is.
                signals[Signal::Session] = if session_home == Some(r.id) && !is_saturated {
                    1.0 - (held / blocks.max(1) as f64).clamp(0.0, 1.0)
                } else {
                    0.0
                };
                signals[Signal::Kv] = 1.0 - r.kv_usage.unwrap_or(0.0).clamp(0.0, 1.0);
                signals[Signal::Adapter] = r.adapter_fit;
                // Like stickiness, placement yields to saturation.
                signals[Signal::Spread] = if is_saturated { 0.0 } else { spread(r.id) };
                Candidate {
                    replica: r.id,
                    total: signals.weighted(&w.0),
                    signals,
                    ring_distance: distance[i],
                    saturated: is_saturated,
                    load_cap,
                    prefix_blocks: held,
                    prefill_tokens: prompt.uncached(held),
                    prefill_backlog: r.prefill_ahead(),
                    step_wait: prompt.step_wait_on(r),
                    kv_wait: prompt.kv_wait_on(r, prompt.uncached(held_or_shared(r, held))),
                    in_flight: r.in_flight,
                }
            })
            .collect();
        let by_total = |a: &Candidate, b: &Candidate| {
            b.total
                .total_cmp(&a.total)
                .then(a.ring_distance.cmp(&b.ring_distance))
                .then(a.replica.cmp(&b.replica))
        };
        let (drawn, tied) = draw_tie(&ranked, by_total, c.tie_margin, features.tie_draw);
        // Only the first `top` need ordering: a partial selection, then a sort of those.
        let order = |a: &Candidate, b: &Candidate| {
            let first = |x: &Candidate| Some(x.replica) == drawn;
            first(b).cmp(&first(a)).then(by_total(a, b))
        };
        if top < ranked.len() {
            if top > 0 {
                ranked.select_nth_unstable_by(top - 1, order);
            }
            ranked.truncate(top);
        }
        ranked.sort_unstable_by(order);
        Decision {
            ranked,
            load_bound,
            hot_group: hot,
            opens_session,
            session_past_cache,
            tied,
        }
    }
}

/// The replica drawn from a tie, and how many were tied: those within `margin` of the best
/// total (by `order`) that hold at least as much of the prompt as the best, when it holds some;
/// the `draw`-th of them in `order`, modulo their number. `(None, 1)` when there is no tie.
fn draw_tie(
    candidates: &[Candidate],
    order: impl Fn(&Candidate, &Candidate) -> std::cmp::Ordering,
    margin: f64,
    draw: u64,
) -> (Option<ReplicaId>, u32) {
    let Some(best) = candidates.iter().min_by(|a, b| order(a, b)) else {
        return (None, 0);
    };
    if margin <= 0.0 || best.prefix_blocks <= 0.0 {
        return (None, 1);
    }
    let mut tied: Vec<&Candidate> = candidates
        .iter()
        .filter(|c| c.total >= best.total - margin && c.prefix_blocks >= best.prefix_blocks)
        .collect();
    if tied.len() < 2 {
        return (None, 1);
    }
    tied.sort_unstable_by(|a, b| order(a, b));
    let pick = tied[(draw % tied.len() as u64) as usize];
    (Some(pick.replica), tied.len() as u32)
}

mod candidate;
mod groups;
mod kv_room;
mod session_room;

#[cfg(test)]
mod tests;
