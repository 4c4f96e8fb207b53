//! The consistent-hash ring. Points come from replica *names*, not slots, so every gateway
//! replica with the same membership builds the same ring and picks the same cold-prefix owner.

use crate::ReplicaId;
use xxhash_rust::xxh3::xxh3_64_with_seed;

#[derive(Debug, Clone, Default)]
pub struct HashRing {
    /// (position, replica), sorted by position.
    points: Vec<(u64, ReplicaId)>,
    /// Each replica slot's positions, sorted.
    by_slot: Vec<Vec<u64>>,
}

impl HashRing {
    pub fn new<'a>(members: impl IntoIterator<Item = (ReplicaId, &'a str)>, vnodes: u32) -> Self {
        let mut points: Vec<(u64, ReplicaId)> = members
            .into_iter()
            .flat_map(|(id, name)| {
                (0..vnodes).map(move |v| (xxh3_64_with_seed(name.as_bytes(), u64::from(v)), id))
            })
            .collect();
        points.sort_unstable();
        let mut by_slot: Vec<Vec<u64>> = Vec::new();
        for &(pos, id) in &points {
            let slot = id.0 as usize;
            if by_slot.len() <= slot {
                by_slot.resize_with(slot + 1, Vec::new);
            }
            by_slot[slot].push(pos);
        }
        HashRing { points, by_slot }
    }

    /// How far clockwise from `key` the replica's first point lies (`None`: not on the ring).
    /// Ordering replicas by (distance, id) is the order in which [`HashRing::walk`] first
    /// meets them, at the cost of one binary search per replica instead of a walk.
    pub fn distance(&self, id: ReplicaId, key: u64) -> Option<u64> {
        let points = self.by_slot.get(id.0 as usize).filter(|p| !p.is_empty())?;
        let at = points.partition_point(|&pos| pos < key);
        let first = points.get(at).unwrap_or(&points[0]);
        Some(first.wrapping_sub(key))
    }

    pub fn is_empty(&self) -> bool {
        self.points.is_empty()
    }

    /// Ring points clockwise from `key`, wrapping once around (replicas repeat).
    pub fn walk(&self, key: u64) -> impl Iterator<Item = ReplicaId> + '_ {
        let start = self.points.partition_point(|&(pos, _)| pos < key);
        self.points[start..]
            .iter()
            .chain(&self.points[..start])
            .map(|&(_, id)| id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_members_give_the_same_ring_in_any_order() {
        let a = HashRing::new([(ReplicaId(0), "x"), (ReplicaId(1), "y")], 8);
        let b = HashRing::new([(ReplicaId(1), "y"), (ReplicaId(0), "x")], 8);
        for key in [0, 42, u64::MAX / 3, u64::MAX] {
            assert_eq!(a.walk(key).next(), b.walk(key).next());
        }
        assert_eq!(a.walk(5).count(), 16);
    }

    #[test]
    fn distances_order_replicas_as_the_walk_meets_them() {
        let names: Vec<String> = (0..50).map(|i| format!("r{i}")).collect();
        let ring = HashRing::new(
            names
                .iter()
                .enumerate()
                .map(|(i, n)| (ReplicaId(i as u32), n.as_str())),
            8,
        );
        for k in 0..200u64 {
            let key = xxh3_64_with_seed(&k.to_le_bytes(), 9);
            let mut walked: Vec<ReplicaId> = Vec::new();
            for id in ring.walk(key) {
                if !walked.contains(&id) {
                    walked.push(id);
                }
            }
            let mut by_distance: Vec<ReplicaId> = (0..50).map(ReplicaId).collect();
            by_distance.sort_by_key(|&id| (ring.distance(id, key), id));
            assert_eq!(walked, by_distance, "key {key}");
        }
        assert_eq!(ring.distance(ReplicaId(50), 0), None);
    }

    #[test]
    fn adding_a_member_moves_only_its_share_of_keys() {
        let names: Vec<String> = (0..8).map(|i| format!("r{i}")).collect();
        let before = HashRing::new(
            names
                .iter()
                .take(7)
                .enumerate()
                .map(|(i, n)| (ReplicaId(i as u32), n.as_str())),
            40,
        );
        let after = HashRing::new(
            names
                .iter()
                .enumerate()
                .map(|(i, n)| (ReplicaId(i as u32), n.as_str())),
            40,
        );
        let keys = 10_000u64;
        let moved = (0..keys)
            .map(|k| xxh3_64_with_seed(&k.to_le_bytes(), 1))
            .filter(|&k| before.walk(k).next() != after.walk(k).next())
            .count();
        // Ideal: 1/8 of keys move to the new member, and only to it.
        assert!(moved < (keys as usize) / 4, "{moved} of {keys} keys moved");
    }
}
