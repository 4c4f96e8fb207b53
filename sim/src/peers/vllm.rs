//! vLLM router's `consistent_hash`.

use kvgate_policies::{HashRing, ReplicaId};

/// vLLM router's `consistent_hash`: the request's key (its `X-Session-ID`, else `X-User-ID`
/// header — `kvgate bench` sends a job's prefix group there with `--group-header x-user-id`,
/// as the routing experiment does — else the prompt) hashed onto a ring of 160 virtual nodes
/// per worker, clockwise to the first worker. No load enters.
#[derive(Debug, Clone)]
pub struct ConsistentHash {
    ring: HashRing,
}

impl ConsistentHash {
    pub fn new(names: &[String]) -> Self {
        let members = names
            .iter()
            .enumerate()
            .map(|(i, n)| (ReplicaId(i as u32), n.as_str()));
        ConsistentHash {
            ring: HashRing::new(members, 160),
        }
    }

    pub fn choose(&self, key: &[u8]) -> usize {
        let key = xxhash_rust::xxh3::xxh3_64(key);
        self.ring.walk(key).next().map_or(0, |r| r.0 as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_keeps_its_worker_and_keys_spread() {
        let names: Vec<String> = (0..4).map(|i| format!("sim-{i}")).collect();
        let ch = ConsistentHash::new(&names);
        assert_eq!(ch.choose(b"group-1"), ch.choose(b"group-1"));
        let mut used = [0; 4];
        for g in 0..400 {
            used[ch.choose(format!("group-{g}").as_bytes())] += 1;
        }
        assert!(used.iter().all(|&n| n > 50), "{used:?}");
    }
}
