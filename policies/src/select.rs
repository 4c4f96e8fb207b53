//! Selection: filter, score, rank.

use crate::load_cap::{FleetLoad, LoadCaps};
use crate::prefill::PromptWork;
use crate::sessions::SessionTable;
use crate::{
    Applied, ApproxPrefixIndex, FleetView, HashRing, PolicyConfig, PreciseIndex, ReplicaId,
    RequestFeatures,
};
use kvgate_protocol::telemetry::KvUpdate;
use serde::Serialize;

/// Normalised signal values, each in [0, 1], before weighting.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Signals {
    pub prefix: f64,
    pub ring: f64,
    pub load: f64,
    pub prefill: f64,
    pub fresh: f64,
    pub session: f64,
    pub kv: f64,
    pub adapter: f64,
}

/// One ranked replica and why it got its score.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Candidate {
    #[serde(skip)]
    pub replica: ReplicaId,
    pub total: f64,
    pub signals: Signals,
    /// How far clockwise from the request's ring key the replica's first ring point lies
    /// (`u64::MAX` off the ring): the tie-breaker, so that every gateway replica breaks ties
    /// alike.
    pub ring_distance: u64,
    /// At or over its load cap (or a hard limit: the imbalance guard, its own
    /// `max_in_flight`, KV or queue limit): prefix and session stickiness are suspended (the
    /// prefill signal only at a hard limit).
    pub saturated: bool,
    /// Its bounded-load cap for this request: the decision's `load_bound`, raised by
    /// `cached_load_bonus` where it holds more of the prompt than the others.
    pub load_cap: u32,
    /// The leading prompt blocks (or text chunks) it holds, as the prefix index knows them;
    /// counted even when saturated.
    pub prefix_blocks: f64,
    /// The prompt tokens it would prefill (those it is not known to hold): what routing the
    /// request here adds to its prefill backlog.
    pub prefill_tokens: u64,
    pub in_flight: u32,
}

/// A replica's limits in one decision.
#[derive(Debug, Clone, Copy)]
struct Limits {
    /// Its bounded-load cap.
    cap: u32,
    /// At its cap or a hard limit: prefix and session stickiness yield.
    saturated: bool,
    /// At a hard limit (the imbalance guard, its `max_in_flight`, its agent's reported KV or
    /// queue saturation): the prefill signal yields too.
    full: bool,
}

/// The outcome of one selection: healthy candidates, best first.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Decision {
    pub ranked: Vec<Candidate>,
    /// The bounded-load cap for cold placement in this decision (a replica holding more of the
    /// prompt may have a higher one: [`Candidate::load_cap`]).
    pub load_bound: u32,
}

/// The routing policy and the state it learns (prefix indexes, sessions, ring).
#[derive(Debug, Clone)]
pub struct Policy {
    config: PolicyConfig,
    ring: HashRing,
    prefix: ApproxPrefixIndex,
    precise: PreciseIndex,
    sessions: SessionTable,
    members: Vec<(ReplicaId, String)>,
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
            members: Vec::new(),
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

    /// Sets the fleet membership: each replica's slot and its stable name (which places it on
    /// the ring). Slots no longer present lose what the index learned about them.
    pub fn set_members(&mut self, members: &[(ReplicaId, &str)]) {
        for (old, _) in &self.members {
            if !members.iter().any(|(id, _)| id == old) {
                self.prefix.clear_replica(*old);
                self.precise.clear_replica(*old);
                self.sessions.forget_replica(*old);
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
        if features.block_hashes.is_empty() {
            self.prefix.insert(replica, &features.prefix_chunks);
        } else {
            let expires = features.now_ms + self.config.speculative_ttl_ms;
            let hashes = &features.block_hashes;
            self.precise
                .speculate(replica, hashes, held, features.now_ms, expires);
        }
        if let Some(session) = features.session {
            let c = &self.config;
            self.sessions.bind(
                session,
                replica,
                features.now_ms,
                c.session_ttl_ms,
                c.session_capacity,
            );
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
    /// slot, and the prompt's length in the same unit.
    fn prefix_overlap(
        &self,
        features: &RequestFeatures,
        fleet: FleetView<'_>,
    ) -> (Vec<f64>, usize) {
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
            (matched, features.prefix_chunks.len())
        } else {
            let hashes = &features.block_hashes;
            self.precise.overlaps(hashes, features.now_ms, &mut matched);
            (matched, hashes.len())
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
        let (matched, blocks) = self.prefix_overlap(features, fleet);
        let load = FleetLoad::of(fleet.replicas.iter(), &matched);
        if load.healthy == 0 {
            return Decision::default();
        }
        let c = &self.config;
        let caps = LoadCaps::new(c, &load, &matched, blocks);
        let load_bound = caps.bound;
        let limits: Vec<Limits> = fleet
            .replicas
            .iter()
            .map(|r| {
                let full = r.in_flight >= caps.guard()
                    || r.max_in_flight.is_some_and(|m| r.in_flight >= m)
                    || r.kv_usage.is_some_and(|u| u >= c.kv_saturation)
                    || r.waiting >= c.queue_saturation;
                let cap = caps.of(r);
                Limits {
                    cap,
                    saturated: full || r.in_flight >= cap,
                    full,
                }
            })
            .collect();

        // The least prefill work ahead of the first token on a replica below its hard limits.
        let prompt = PromptWork::new(features.prompt_tokens, blocks);
        let least_work = fleet
            .replicas
            .iter()
            .zip(&limits)
            .filter(|(r, l)| r.healthy && !l.full)
            .map(|(r, _)| prompt.ahead_on(r, matched[r.id.0 as usize]))
            .min()
            .unwrap_or_default();

        // Ring order of the candidates, and the bounded-load owner: the first healthy,
        // unsaturated replica clockwise from the key.
        let distance: Vec<u64> = fleet
            .replicas
            .iter()
            .map(|r| {
                self.ring
                    .distance(r.id, features.ring_key)
                    .unwrap_or(u64::MAX)
            })
            .collect();
        let owner = fleet
            .replicas
            .iter()
            .zip(&distance)
            .zip(&limits)
            .filter(|((r, &d), l)| d != u64::MAX && r.healthy && !l.saturated)
            .min_by_key(|((r, &d), _)| (d, r.id))
            .map(|((r, _), _)| r.id);

        let w = features.weights.as_ref().unwrap_or(&c.weights);
        let session_home = features
            .session
            .and_then(|s| self.sessions.get(s, features.now_ms, c.session_ttl_ms));
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
                let signals = Signals {
                    prefix: if is_saturated {
                        0.0
                    } else {
                        held / blocks.max(1) as f64
                    },
                    ring: if owner == Some(r.id) { 1.0 } else { 0.0 },
                    load: 1.0
                        - f64::from(r.in_flight.saturating_add(r.waiting))
                            / (f64::from(load.busiest) + 1.0),
                    // It weighs load in tokens, so only the hard limits stop it; at its
                    // bounded-load cap a holder still has less to compute than the others.
                    prefill: if full {
                        0.0
                    } else {
                        prompt.relative(least_work, prompt.ahead_on(r, held))
                    },
                    fresh: if r.stale { 0.0 } else { 1.0 },
                    // Stickiness yields only to saturation.
                    session: if session_home == Some(r.id) && !is_saturated {
                        1.0
                    } else {
                        0.0
                    },
                    kv: 1.0 - r.kv_usage.unwrap_or(0.0).clamp(0.0, 1.0),
                    adapter: r.adapter_fit,
                };
                Candidate {
                    replica: r.id,
                    total: w.prefix * signals.prefix
                        + w.ring * signals.ring
                        + w.load * signals.load
                        + w.prefill * signals.prefill
                        + w.fresh * signals.fresh
                        + w.session * signals.session
                        + w.kv * signals.kv
                        + w.adapter * signals.adapter,
                    signals,
                    ring_distance: distance[i],
                    saturated: is_saturated,
                    load_cap,
                    prefix_blocks: held,
                    prefill_tokens: prompt.uncached(held),
                    in_flight: r.in_flight,
                }
            })
            .collect();
        // Only the first `top` need ordering: a partial selection, then a sort of those.
        let order = |a: &Candidate, b: &Candidate| {
            b.total
                .total_cmp(&a.total)
                .then(a.ring_distance.cmp(&b.ring_distance))
                .then(a.replica.cmp(&b.replica))
        };
        if top < ranked.len() {
            if top > 0 {
                ranked.select_nth_unstable_by(top - 1, order);
            }
            ranked.truncate(top);
        }
        ranked.sort_unstable_by(order);
        Decision { ranked, load_bound }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ReplicaView;
    use proptest::prelude::*;

    fn policy(n: u32) -> Policy {
        policy_with(n, PolicyConfig::default())
    }

    fn policy_with(n: u32, config: PolicyConfig) -> Policy {
        let mut p = Policy::new(config);
        let names: Vec<String> = (0..n).map(|i| format!("http://replica-{i}")).collect();
        let members: Vec<(ReplicaId, &str)> = names
            .iter()
            .enumerate()
            .map(|(i, s)| (ReplicaId(i as u32), s.as_str()))
            .collect();
        p.set_members(&members);
        p
    }

    fn view(loads: &[u32]) -> Vec<ReplicaView> {
        loads
            .iter()
            .enumerate()
            .map(|(i, &l)| ReplicaView {
                id: ReplicaId(i as u32),
                healthy: true,
                in_flight: l,
                max_in_flight: None,
                waiting: 0,
                prefill_backlog: 0,
                stale: false,
                kv_usage: None,
                adapter_fit: 0.0,
            })
            .collect()
    }

    /// Routes `f` on an idle three-replica fleet and records the choice: its home.
    fn place_on_idle(p: &mut Policy, f: &RequestFeatures) -> ReplicaId {
        let home = p
            .select(
                f,
                FleetView {
                    replicas: &view(&[0, 0, 0]),
                },
            )
            .ranked[0]
            .replica;
        p.record(home, f);
        home
    }

    fn features(key: u64, chunks: &[u64]) -> RequestFeatures {
        RequestFeatures {
            prefix_chunks: chunks.to_vec(),
            ring_key: key,
            ..Default::default()
        }
    }

    #[test]
    fn a_session_keeps_its_replica_until_saturation_or_expiry() {
        let mut p = policy(4);
        let mut fleet = view(&[0, 0, 0, 0]);
        let turn = |key: u64, now_ms: u64| RequestFeatures {
            session: Some(77),
            now_ms,
            ..features(key, &[key])
        };
        let first = p.select(&turn(1, 0), FleetView { replicas: &fleet });
        let home = first.ranked[0].replica;
        p.record(home, &turn(1, 0));
        // Unrelated prompts (other ring owners, no shared prefix) follow the session.
        for (i, key) in (2..12u64).enumerate() {
            let f = turn(key * 7919, 1000 * i as u64);
            let d = p.select(&f, FleetView { replicas: &fleet });
            assert_eq!(d.ranked[0].replica, home, "turn {i}");
            assert_eq!(d.ranked[0].signals.session, 1.0);
            p.record(home, &f);
        }
        // Saturated: the session yields.
        fleet[home.0 as usize].in_flight = 10;
        let d = p.select(&turn(5, 20_000), FleetView { replicas: &fleet });
        assert_ne!(d.ranked[0].replica, home);
        // Idle past the TTL: the binding is gone.
        fleet[home.0 as usize].in_flight = 0;
        let late = 20_000 + p.config().session_ttl_ms;
        let d = p.select(&turn(5, late), FleetView { replicas: &fleet });
        assert!(d.ranked.iter().all(|c| c.signals.session == 0.0));
    }

    #[test]
    fn cold_prefix_goes_to_the_ring_owner_and_warm_prefix_sticks() {
        let mut p = policy(4);
        let fleet = view(&[0, 0, 0, 0]);
        let f = features(12345, &[1, 2, 3]);
        let first = p.select(&f, FleetView { replicas: &fleet });
        let owner = first.ranked[0].replica;
        assert_eq!(first.ranked[0].signals.ring, 1.0);
        p.record(owner, &f);
        // Same prefix, different ring key (e.g. a different suffix): the prefix holder wins.
        let again = p.select(
            &features(999, &[1, 2, 3, 4]),
            FleetView { replicas: &fleet },
        );
        assert_eq!(again.ranked[0].replica, owner);
        assert_eq!(again.ranked[0].signals.prefix, 0.75);
    }

    #[test]
    fn saturated_holder_yields_its_prefix() {
        let mut p = policy(3);
        let f = features(7, &[1, 2]);
        let idle = view(&[0, 0, 0]);
        let owner = p.select(&f, FleetView { replicas: &idle }).ranked[0].replica;
        p.record(owner, &f);
        let mut loads = [0u32; 3];
        loads[owner.0 as usize] = 5; // bound = ceil(1.25 * 6 / 3) = 3
        let busy = view(&loads);
        let d = p.select(&f, FleetView { replicas: &busy });
        assert_eq!(d.load_bound, 3);
        assert_ne!(d.ranked[0].replica, owner);
        let held = d.ranked.iter().find(|c| c.replica == owner).unwrap();
        assert!(held.saturated && held.signals.prefix == 0.0);
    }

    #[test]
    fn cached_load_bonus_keeps_a_prompt_home_past_the_cold_bound() {
        let config = PolicyConfig {
            cached_load_bonus: 0.5,
            imbalance_factor: 0.0,
            ..Default::default()
        };
        let mut p = policy_with(3, config);
        let f = features(7, &[1, 2]);
        let home = place_on_idle(&mut p, &f);
        let loads_with_home_at = |load: u32| {
            let mut loads = [3u32; 3];
            loads[home.0 as usize] = load;
            view(&loads)
        };
        // 7 in flight: over the cold bound ceil(1.25 * 14 / 3) = 6, under the home's cap
        // ceil((1.25 + 0.5) * 14 / 3) = 9.
        let d = p.select(
            &f,
            FleetView {
                replicas: &loads_with_home_at(7),
            },
        );
        assert_eq!(d.load_bound, 6);
        assert_eq!((d.ranked[0].replica, d.ranked[0].load_cap), (home, 9));
        assert!(d.ranked[1..].iter().all(|c| c.load_cap == 6));
        // 10 in flight reaches its cap, ceil(1.75 * 17 / 3) = 10: the prompt spills.
        let d = p.select(
            &f,
            FleetView {
                replicas: &loads_with_home_at(10),
            },
        );
        assert_ne!(d.ranked[0].replica, home);
        // A prompt nobody holds is placed under the cold bound everywhere.
        let cold = p.select(
            &features(8, &[5, 6]),
            FleetView {
                replicas: &loads_with_home_at(7),
            },
        );
        assert!(cold.ranked.iter().all(|c| c.load_cap == 6));
    }

    #[test]
    fn a_replica_without_the_shared_prefix_does_not_starve() {
        let config = |imbalance_factor| PolicyConfig {
            imbalance_factor,
            ..Default::default()
        };
        let shared = RequestFeatures {
            prompt_tokens: 1_000,
            ..features(3, &[1, 2, 3])
        };
        let busy = view(&[1, 4, 1, 1]);
        for factor in [2.0, 0.0] {
            let mut p = policy_with(4, config(factor));
            p.record(ReplicaId(1), &shared);
            let pick = p.select(&shared, FleetView { replicas: &busy }).ranked[0].replica;
            if factor > 0.0 {
                // 4 in flight is 2 x (1 + 1), and a holder's cap is ceil(1.75 * 8 / 4) = 4.
                assert_ne!(pick, ReplicaId(1));
            } else {
                // Without the guard the holder keeps it: at its cap, it still has the least
                // to prefill.
                assert_eq!(pick, ReplicaId(1));
            }
        }
    }

    #[test]
    fn the_guard_is_never_below_a_holders_cap() {
        // One replica has just drained (0 in flight) while the home has 11: 3 x (0 + 1) would
        // make it spill, and so would the cold bound ceil(1.25 * 30 / 4) = 10, but a replica
        // holding the whole prompt may carry ceil(1.75 * 30 / 4) = 14.
        let mut p = policy(4);
        let shared = features(3, &[1, 2, 3]);
        p.record(ReplicaId(1), &shared);
        let d = p.select(
            &shared,
            FleetView {
                replicas: &view(&[0, 11, 9, 9]),
            },
        );
        assert_eq!(d.ranked[0].replica, ReplicaId(1));
    }

    #[test]
    fn a_prefill_backlog_steers_a_cold_prompt_past_its_ring_owner() {
        let p = policy(3);
        let f = RequestFeatures {
            prompt_tokens: 2_000,
            ..features(7, &[1, 2, 3, 4])
        };
        let idle = view(&[1, 1, 1]);
        let owner = p.select(&f, FleetView { replicas: &idle }).ranked[0].replica;
        // As many requests everywhere, but the owner is prefilling a long document.
        let mut busy = idle.clone();
        busy[owner.0 as usize].prefill_backlog = 30_000;
        let d = p.select(&f, FleetView { replicas: &busy });
        assert_ne!(d.ranked[0].replica, owner);
        assert_eq!(d.ranked[0].signals.prefill, 1.0);
        assert_eq!(d.ranked[0].prefill_tokens, 2_000);
        let o = d.ranked.iter().find(|c| c.replica == owner).unwrap();
        assert_eq!(o.signals.ring, 1.0);
        assert!(o.signals.prefill < 0.2, "{}", o.signals.prefill);
    }

    #[test]
    fn a_held_prompt_outweighs_a_short_backlog() {
        let mut p = policy(3);
        let f = RequestFeatures {
            prompt_tokens: 1_000,
            ..features(7, &[1, 2, 3, 4])
        };
        let home = place_on_idle(&mut p, &f);
        let mut fleet = view(&[1, 1, 1]);
        fleet[home.0 as usize].prefill_backlog = 500;
        // Another ring key: only what the replicas hold tells them apart.
        let again = RequestFeatures {
            ring_key: 999,
            ..f.clone()
        };
        let d = p.select(&again, FleetView { replicas: &fleet });
        assert_eq!(d.ranked[0].replica, home);
        assert_eq!(d.ranked[0].prefill_tokens, 0);
        // 500 tokens ahead at home against 1,000 to compute anywhere else.
        assert_eq!(d.ranked[0].signals.prefill, 1.0);
        assert_eq!(d.ranked[1].signals.prefill, 0.75);
    }

    #[test]
    fn unhealthy_replicas_are_filtered_and_an_empty_fleet_ranks_nothing() {
        let p = policy(2);
        let mut fleet = view(&[0, 0]);
        fleet[0].healthy = false;
        let d = p.select(&features(1, &[]), FleetView { replicas: &fleet });
        assert_eq!(
            d.ranked.iter().map(|c| c.replica).collect::<Vec<_>>(),
            vec![ReplicaId(1)]
        );
        fleet[1].healthy = false;
        assert!(p
            .select(&features(1, &[]), FleetView { replicas: &fleet })
            .ranked
            .is_empty());
    }

    proptest! {
        /// Bounded load: routing each new request to the top candidate and counting it in
        /// flight never pushes a replica past ceil(c * total / n) for cold prefixes, nor past
        /// ceil((c + bonus) * total / n) where it holds the prompt, unless the prefill signal
        /// (load in tokens) keeps it there; and nothing, whatever the prefill backlogs, pushes
        /// a replica past the imbalance guard.
        #[test]
        fn bounded_load_holds(
            requests in prop::collection::vec((any::<u64>(), 0u64..6, 0u64..20_000), 1..200),
            n in 1u32..9,
            bonus in prop::sample::select(vec![0.0, 0.5, 1.0]),
            imbalance in prop::sample::select(vec![0.0, 2.0, 3.0]),
            prefill in prop::sample::select(vec![0.0, 6.0]),
        ) {
            let mut config = PolicyConfig { cached_load_bonus: bonus, imbalance_factor: imbalance, ..Default::default() };
            config.weights.prefill = prefill;
            let mut p = policy_with(n, config);
            let c = p.config().load_factor;
            let mut loads = vec![0u32; n as usize];
            let mut backlogs = vec![0u64; n as usize];
            for (k, &(key, group, backlog)) in requests.iter().enumerate() {
                // Group 0 is a cold, unshared prompt; the others recur.
                let chunks: Vec<u64> = if group == 0 { vec![] } else { vec![group, group + 100] };
                let f = RequestFeatures { prompt_tokens: 1_000, ..features(key, &chunks) };
                // Prefill backlogs unrelated to the request counts: the bound holds anyway.
                backlogs[k % n as usize] = backlog;
                let mut fleet = view(&loads);
                for (r, &b) in fleet.iter_mut().zip(&backlogs) {
                    r.prefill_backlog = b;
                }
                let least = *loads.iter().min().unwrap();
                let d = p.select(&f, FleetView { replicas: &fleet });
                let pick = d.ranked[0];
                p.record_choice(&pick, &f);
                let i = pick.replica.0 as usize;
                loads[i] += 1;
                let cap_at = |factor: f64| ((factor * (k + 1) as f64 / f64::from(n)).ceil() as u32).max(1);
                let cap = cap_at(if pick.prefix_blocks > 0.0 { c + bonus } else { c });
                prop_assert!(pick.load_cap <= cap);
                if prefill == 0.0 {
                    prop_assert!(loads[i] <= cap, "load {} over cap {}", loads[i], cap);
                }
                if imbalance > 0.0 {
                    let guard = ((imbalance * f64::from(least + 1)).ceil() as u32).max(cap_at(c + bonus));
                    prop_assert!(loads[i] <= guard, "load {} over {}x the idlest or a holder's cap", loads[i], imbalance);
                }
            }
        }

        #[test]
        fn ranking_is_deterministic_and_complete(key in any::<u64>(), loads in prop::collection::vec(0u32..10, 1..12)) {
            let p = policy(loads.len() as u32);
            let fleet = view(&loads);
            let a = p.select(&features(key, &[]), FleetView { replicas: &fleet });
            let b = p.select(&features(key, &[]), FleetView { replicas: &fleet });
            prop_assert_eq!(&a, &b);
            let mut ranked: Vec<u32> = a.ranked.iter().map(|c| c.replica.0).collect();
            ranked.sort();
            prop_assert_eq!(ranked, (0..loads.len() as u32).collect::<Vec<_>>());
            for top in 0..=loads.len() + 1 {
                let head = p.select_top(&features(key, &[]), FleetView { replicas: &fleet }, top);
                prop_assert_eq!(&head.ranked[..], &a.ranked[..top.min(loads.len())]);
            }
        }
    }
}
