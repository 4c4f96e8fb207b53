//! Recent traffic per replica: the requests routed to it, halved every half-life. Cold
//! placement asks it which replicas already carry more than their share, because a replica's
//! requests in flight at one instant say little about the prefixes it serves: an idle moment
//! between two bursts of a popular group looks like room.

use crate::lru::LruSet;
use kvgate_protocol::HashKeyMap;

/// A decayed count per replica slot, and their sum (every count decays alike, so the sum is
/// one decayed count too: no pass over the slots to total them).
#[derive(Debug, Clone, Default)]
pub(crate) struct RecentTraffic {
    /// By slot: the count as of `at_ms`.
    slots: Vec<Decayed>,
    total: Decayed,
}

/// A decayed count per prefix group (a prompt's leading blocks or chunks), for the groups seen
/// most recently: whether a group brings more traffic than the replicas holding it can take.
#[derive(Debug, Clone)]
pub(crate) struct GroupTraffic {
    recent: LruSet,
    counts: HashKeyMap<Decayed>,
}

#[derive(Debug, Clone, Copy, Default)]
struct Decayed {
    count: f64,
    at_ms: u64,
}

impl Decayed {
    fn at(self, now_ms: u64, half_life_ms: u64) -> f64 {
        let elapsed = now_ms.saturating_sub(self.at_ms) as f64;
        self.count * (-elapsed / half_life_ms.max(1) as f64).exp2()
    }

    /// Adds `n` (negative to take away) at `now_ms`.
    fn add(&mut self, n: f64, now_ms: u64, half_life_ms: u64) {
        *self = Decayed {
            count: (self.at(now_ms, half_life_ms) + n).max(0.0),
            at_ms: now_ms.max(self.at_ms),
        };
    }
}

impl RecentTraffic {
    /// Counts one request routed to `slot` at `now_ms`.
    pub fn add(&mut self, slot: usize, now_ms: u64, half_life_ms: u64) {
        self.add_n(slot, 1.0, now_ms, half_life_ms);
    }

    /// Counts `n` (blocks, say) at `slot` at `now_ms`.
    pub fn add_n(&mut self, slot: usize, n: f64, now_ms: u64, half_life_ms: u64) {
        if self.slots.len() <= slot {
            self.slots.resize(slot + 1, Decayed::default());
        }
        self.slots[slot].add(n, now_ms, half_life_ms);
        self.total.add(n, now_ms, half_life_ms);
    }

    /// The sum of every slot's count at `now_ms`.
    pub fn total(&self, now_ms: u64, half_life_ms: u64) -> f64 {
        self.total.at(now_ms, half_life_ms)
    }

    /// The decayed count of `slot` at `now_ms` (0 for a slot never counted).
    pub fn of(&self, slot: usize, now_ms: u64, half_life_ms: u64) -> f64 {
        self.slots
            .get(slot)
            .map_or(0.0, |d| d.at(now_ms, half_life_ms))
    }

    /// Forgets a slot (its replica left the fleet), and its part of the sum.
    pub fn clear(&mut self, slot: usize, half_life_ms: u64) {
        if let Some(d) = self.slots.get_mut(slot) {
            let gone = std::mem::take(d);
            let at = self.total.at_ms.max(gone.at_ms);
            self.total.add(-gone.at(at, half_life_ms), at, half_life_ms);
        }
    }
}

/// A mean of recent values, each weighed by how recent it is (halved every half-life).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct RecentMean {
    sum: Decayed,
    count: Decayed,
}

impl RecentMean {
    /// Counts a value (at least 0) at `now_ms`.
    pub fn add(&mut self, value: f64, now_ms: u64, half_life_ms: u64) {
        self.sum.add(value.max(0.0), now_ms, half_life_ms);
        self.count.add(1.0, now_ms, half_life_ms);
    }

    /// The mean at `now_ms` (`None` before the first value).
    pub fn at(&self, now_ms: u64, half_life_ms: u64) -> Option<f64> {
        let count = self.count.at(now_ms, half_life_ms);
        (count > 0.0).then(|| self.sum.at(now_ms, half_life_ms) / count)
    }
}

impl GroupTraffic {
    /// Counts at most `capacity` groups, forgetting the least recently routed.
    pub fn new(capacity: usize) -> Self {
        GroupTraffic {
            recent: LruSet::new(capacity),
            counts: HashKeyMap::default(),
        }
    }

    /// Counts one request of `group` at `now_ms`; returns its decayed count before this one.
    pub fn add(&mut self, group: u64, now_ms: u64, half_life_ms: u64) -> f64 {
        if let Some(gone) = self.recent.insert(group) {
            self.counts.remove(&gone);
        }
        let count = self.counts.entry(group).or_default();
        let before = count.at(now_ms, half_life_ms);
        count.add(1.0, now_ms, half_life_ms);
        before
    }

    /// The decayed count of `group` at `now_ms` (0 for one not counted).
    pub fn of(&self, group: u64, now_ms: u64, half_life_ms: u64) -> f64 {
        self.counts
            .get(&group)
            .map_or(0.0, |d| d.at(now_ms, half_life_ms))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_halve_every_half_life() {
        let mut t = RecentTraffic::default();
        t.add(2, 1_000, 500);
        t.add(2, 1_000, 500);
        assert_eq!(t.of(2, 1_000, 500), 2.0);
        assert!((t.of(2, 1_500, 500) - 1.0).abs() < 1e-12);
        t.add(2, 1_500, 500);
        assert!((t.of(2, 2_000, 500) - 1.0).abs() < 1e-12);
        assert_eq!(t.of(0, 2_000, 500), 0.0);
        assert_eq!(t.of(9, 2_000, 500), 0.0);
        t.add(0, 2_000, 500);
        assert!((t.total(2_000, 500) - 2.0).abs() < 1e-12);
        t.clear(2, 500);
        assert_eq!(t.of(2, 2_000, 500), 0.0);
        assert!((t.total(2_000, 500) - 1.0).abs() < 1e-12);
    }

    #[test]
    fn a_recent_mean_weighs_values_by_how_recent_they_are() {
        let mut m = RecentMean::default();
        assert_eq!(m.at(0, 1_000), None);
        m.add(1.0, 0, 1_000);
        m.add(0.0, 1_000, 1_000);
        // The first value is worth half the second by then: (0.5 * 1 + 0) / 1.5.
        assert!((m.at(1_000, 1_000).unwrap_or(0.0) - 1.0 / 3.0).abs() < 1e-12);
        assert!((m.at(5_000, 1_000).unwrap_or(0.0) - 1.0 / 3.0).abs() < 1e-12);
    }

    #[test]
    fn an_earlier_clock_neither_grows_nor_rewinds_a_count() {
        let mut t = RecentTraffic::default();
        t.add(0, 2_000, 1_000);
        // A gateway's clock read on another thread may be a little behind.
        t.add(0, 1_000, 1_000);
        assert_eq!(t.of(0, 2_000, 1_000), 2.0);
        assert_eq!(t.of(0, 1_000, 1_000), 2.0);
    }

    #[test]
    fn group_counts_decay_and_the_least_recently_routed_is_forgotten() {
        let mut g = GroupTraffic::new(2);
        assert_eq!(g.add(1, 0, 1_000), 0.0);
        assert_eq!(g.add(1, 0, 1_000), 1.0, "the count before this request");
        g.add(2, 0, 1_000);
        assert_eq!(g.of(1, 0, 1_000), 2.0);
        assert!((g.of(1, 1_000, 1_000) - 1.0).abs() < 1e-12);
        // A third group evicts group 1, routed least recently.
        g.add(2, 10, 1_000);
        g.add(3, 20, 1_000);
        assert_eq!(g.of(1, 20, 1_000), 0.0);
        assert!(g.of(2, 20, 1_000) > 1.9);
        assert_eq!(g.of(3, 20, 1_000), 1.0);
    }
}
