//! Peer routers' algorithms, written from their documented behaviour, each with its own state
//! per gateway.

mod dynamo;
mod llm_d;
mod sglang;
mod vllm;

pub use dynamo::Dynamo;
pub use llm_d::Llmd;
pub use sglang::CacheAware;
pub use vllm::ConsistentHash;

use std::collections::HashMap;

/// The prompts a router sent to each worker, as chained block hashes: the approximate prefix
/// view of routers that see no KV events (SGLang's tree, llm-d's prefix scorer). Never trimmed:
/// their bounds (SGLang's 2^26 characters, llm-d's 31,250 blocks per worker) are far above these
/// runs.
#[derive(Debug, Clone)]
pub struct RoutedPrefixes {
    /// Block hash → the workers sent a prompt with it.
    holders: HashMap<u64, Vec<u32>>,
    /// Blocks sent to each worker.
    blocks: Vec<usize>,
}

impl RoutedPrefixes {
    pub fn new(workers: usize) -> Self {
        RoutedPrefixes {
            holders: HashMap::new(),
            blocks: vec![0; workers],
        }
    }

    /// Blocks sent to each worker.
    pub fn sizes(&self) -> &[usize] {
        &self.blocks
    }

    /// Each worker's leading run of `blocks` among those sent to it.
    pub fn matched(&self, blocks: &[u64]) -> Vec<usize> {
        let mut run = vec![0; self.blocks.len()];
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

    pub fn insert(&mut self, worker: usize, blocks: &[u64]) {
        for h in blocks {
            let holders = self.holders.entry(*h).or_default();
            if !holders.contains(&(worker as u32)) {
                holders.push(worker as u32);
                self.blocks[worker] += 1;
            }
        }
    }
}

/// The index of the first smallest value.
pub(crate) fn first_min(values: impl Iterator<Item = impl Ord>) -> usize {
    values
        .enumerate()
        .min_by(|a, b| a.1.cmp(&b.1))
        .map_or(0, |(i, _)| i)
}

/// The index of the best of `n` scores (the lowest if `lower`, else the highest), ties broken
/// by starting the scan at `start` (for routers that break ties at random: a rotating start
/// keeps runs reproducible).
pub(crate) fn best_from(
    n: usize,
    start: usize,
    score: impl Fn(usize) -> f64,
    lower: bool,
) -> usize {
    let mut best = start % n.max(1);
    for k in 1..n {
        let w = (start + k) % n;
        let (a, b) = (score(w), score(best));
        if (lower && a < b) || (!lower && a > b) {
            best = w;
        }
    }
    best
}
