//! Sessions past their caches. A replica whose cache holds less than the histories of the
//! sessions live on it evicts, while a turn waits in its queue, the history least recently
//! used, which is the next turn's own: every turn misses there. An even split past the caches'
//! size therefore misses everywhere; a turn whose home is past its cache, and seen computing
//! again what it evicted, goes where its history fits, or else where the overflow already is,
//! so that the others stay under.

use super::Policy;
use crate::sessions::Binding;
use crate::{FleetView, ReplicaId, RequestFeatures};

/// A home is taken to evict its sessions' histories only while at least this share of the
/// blocks it stores are ones it removed shortly before: past its cache by the gateway's
/// count alone, staggered sessions still mostly hit (a cache keeps the most recently used).
const RECOMPUTING_SHARE: f64 = 0.4;

impl Policy {
    /// For a session's request, the tokens of its first prompt that a replica held before it
    /// (token mode): a prefix other sessions share, not the session's own history.
    pub(super) fn shared_part(&self, features: &RequestFeatures) -> u64 {
        let Some(session) = features.session else {
            return 0;
        };
        if let Some(b) = self.sessions.binding(session) {
            return b.shared;
        }
        let hashes = &features.block_hashes;
        if hashes.is_empty() {
            return 0;
        }
        let slots = self.members.iter().map(|(id, _)| id.0 as usize + 1).max();
        let mut matched = vec![0.0; slots.unwrap_or_default()];
        self.precise.overlaps(hashes, features.now_ms, &mut matched);
        let held = matched.iter().fold(0.0, |a: f64, &b| a.max(b));
        (features.prompt_tokens as f64 * held / hashes.len() as f64) as u64
    }

    /// Binds `session` to `replica`, its own history live there.
    pub(super) fn bind_session(
        &mut self,
        session: u64,
        replica: ReplicaId,
        shared: u64,
        features: &RequestFeatures,
    ) {
        let c = &self.config;
        let now = features.now_ms;
        let binding = Binding {
            replica,
            last_ms: now,
            shared,
        };
        self.sessions
            .bind(session, binding, c.session_ttl_ms, c.session_capacity);
        let own = features.prompt_tokens.saturating_sub(shared);
        let limits = (c.traffic_half_life_ms, c.session_ttl_ms, c.session_capacity);
        self.live.turn(session, replica, own, now, limits);
    }

    /// Where this turn of a session goes instead of `home`, if `home` is past its cache with
    /// it and recomputing what it evicted (token mode, with KV reports and events): the
    /// healthy replica with the most room that this prompt fits in, else the one furthest
    /// past its cache if that is not `home`.
    pub(super) fn session_move(
        &self,
        features: &RequestFeatures,
        home: ReplicaId,
        fleet: FleetView<'_>,
    ) -> Option<ReplicaId> {
        let session = features.session?;
        if features.block_hashes.is_empty()
            || self.precise.recompute_share(home) < RECOMPUTING_SHARE
        {
            return None;
        }
        let now = features.now_ms;
        let own = self.live.of_session(session, home, now) as f64;
        let prompt = features
            .prompt_tokens
            .saturating_sub(self.shared_part(features)) as f64;
        // Each replica's live histories against its cache, this turn's where it is now.
        let excess = |id: ReplicaId, cap: u64| {
            let here = if id == home { prompt - own } else { 0.0 };
            self.live.on(id, now) as f64 + here - cap as f64
        };
        let home_cap = fleet
            .replicas
            .iter()
            .find(|r| r.id == home)?
            .kv_capacity_tokens?;
        let home_excess = excess(home, home_cap);
        if home_excess <= 0.0 {
            return None;
        }
        let others = fleet
            .replicas
            .iter()
            .filter(|r| r.healthy && r.id != home)
            .filter_map(|r| Some((r.id, excess(r.id, r.kv_capacity_tokens?))));
        let roomiest = others
            .clone()
            .filter(|&(_, e)| e + prompt <= 0.0)
            .min_by(|a, b| a.1.total_cmp(&b.1));
        if let Some((id, _)) = roomiest {
            return Some(id);
        }
        others
            .filter(|&(_, e)| e > home_excess)
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .map(|(id, _)| id)
    }
}
