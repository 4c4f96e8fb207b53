//! The consistent-hash ring. Points come from replica *names*, not slots, so every gateway
//! replica with the same membership builds the same ring and picks the same cold-prefix owner.

use crate::ReplicaId;
use xxhash_rust::xxh3::xxh3_64_with_seed;

#[derive(Debug, Clone, Default)]
pub struct HashRing {
    /// (position, replica), sorted by position.
    points: Vec<(u64, ReplicaId)>,
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
        HashRing { points }
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
