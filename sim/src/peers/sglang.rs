//! Peer routers' algorithms, written from their documented behaviour.

use kvgate_policies::{HashRing, ReplicaId};
use std::collections::HashMap;

/// SGLang router's `cache_aware` (router 0.3.2's defaults): each worker's load is the
/// requests the router has in flight on it. When the load is imbalanced — the busiest has more
/// than `balance_abs_threshold` above the idlest and more than `balance_rel_threshold` times
/// it — the request goes to the idlest. Otherwise it goes to the worker whose tree of past
/// prompts matches the longest prefix of this one, if that covers more than `cache_threshold`
/// of it, else to the worker with the smallest tree; either way its prompt joins that
/// worker's tree.
///
/// SGLang's tree holds characters; here it holds the prompt's 16-token blocks (the
/// simulator's prompts are words, one token each), so a match counts whole blocks. Trees are
/// not trimmed (SGLang evicts past `max_tree_size` characters, 2^26 by default, far above
/// these runs).
#[derive(Debug, Clone)]
pub struct CacheAware {
    pub cache_threshold: f64,
    pub balance_abs_threshold: u32,
    pub balance_rel_threshold: f64,
    /// Block chain hash → the workers whose tree holds it.
    holders: HashMap<u64, Vec<u32>>,
    /// Blocks in each worker's tree.
    tree_blocks: Vec<usize>,
}

impl CacheAware {
    pub fn new(workers: usize) -> Self {
        CacheAware {
            cache_threshold: 0.3,
            balance_abs_threshold: 64,
            balance_rel_threshold: 1.5,
            holders: HashMap::new(),
            tree_blocks: vec![0; workers],
        }
    }

    /// The worker for a prompt of `blocks` (chained hashes), given each worker's load.
    pub fn choose(&mut self, blocks: &[u64], load: &[u32]) -> usize {
        let (max, min) = (
            load.iter().copied().max().unwrap_or(0),
            load.iter().copied().min().unwrap_or(0),
        );
        let imbalanced = max - min > self.balance_abs_threshold
            && f64::from(max) > self.balance_rel_threshold * f64::from(min);
        let worker = if imbalanced {
            first_min(load.iter().copied())
        } else {
            let matched = self.matched(blocks);
            let (best, run) = matched
                .iter()
                .copied()
                .enumerate()
                .fold((0, 0), |b, (w, r)| if r > b.1 { (w, r) } else { b });
            if !blocks.is_empty() && run as f64 / blocks.len() as f64 > self.cache_threshold {
                best
            } else {
                first_min(self.tree_blocks.iter().copied())
            }
        };
        self.insert(worker, blocks);
        worker
    }

    /// Each worker's leading run of `blocks` in its tree.
    fn matched(&self, blocks: &[u64]) -> Vec<usize> {
        let mut run = vec![0; self.tree_blocks.len()];
        for (i, h) in blocks.iter().enumerate() {
            let Some(holders) = self.holders.get(h) else {
                break;
            };
            let mut any = false;
            for &w in holders {
                if run[w as usize] == i {
                    run[w as usize] = i + 1;
                    any = true;
                }
            }
            if !any {
                break;
            }
        }
        run
    }

    fn insert(&mut self, worker: usize, blocks: &[u64]) {
        for h in blocks {
            let holders = self.holders.entry(*h).or_default();
            if !holders.contains(&(worker as u32)) {
                holders.push(worker as u32);
                self.tree_blocks[worker] += 1;
            }
        }
    }
}

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

/// The index of the first smallest value.
fn first_min(values: impl Iterator<Item = impl Ord>) -> usize {
    values
        .enumerate()
        .min_by(|a, b| a.1.cmp(&b.1))
        .map_or(0, |(i, _)| i)
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

    #[test]
    fn a_matching_prefix_wins_until_the_load_is_imbalanced() {
        let mut ca = CacheAware::new(3);
        let prompt: Vec<u64> = (1..=10).collect();
        // Cold: the smallest tree (all empty: the first).
        assert_eq!(ca.choose(&prompt, &[0, 0, 0]), 0);
        // Another prompt, cold: worker 0's tree is larger now.
        let other: Vec<u64> = (100..110).collect();
        assert_eq!(ca.choose(&other, &[1, 0, 0]), 1);
        // The first prompt's prefix matches worker 0 above the threshold.
        let mut longer = prompt.clone();
        longer.extend(200..204);
        assert_eq!(ca.choose(&longer, &[1, 1, 0]), 0);
        // Imbalanced (70 over 0): the idlest.
        assert_eq!(ca.choose(&longer, &[70, 1, 0]), 2);
        // A match under the threshold: the smallest tree.
        let mut mostly_new = prompt[..2].to_vec();
        mostly_new.extend(300..310);
        assert_eq!(ca.choose(&mostly_new, &[0, 0, 0]), 1);
    }
}
