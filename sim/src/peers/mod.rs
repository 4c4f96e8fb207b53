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

/// The index of the best of `n` scores (the lowest if `lower`, else the highest); a tie goes
/// to the `draw`-th of the tied, counted from the first, modulo their number. Routers that
/// break ties at random pass a hash of the request ([`random_draw`]), so that runs stay
/// reproducible.
pub(crate) fn best_of(n: usize, draw: u64, score: impl Fn(usize) -> f64, lower: bool) -> usize {
    let scores: Vec<f64> = (0..n).map(score).collect();
    let better = |a: f64, b: f64| if lower { a < b } else { a > b };
    let Some(best) = scores
        .iter()
        .copied()
        .reduce(|b, a| if better(a, b) { a } else { b })
    else {
        return 0;
    };
    let tied = scores.iter().filter(|&&s| s == best).count() as u64;
    let pick = (draw % tied.max(1)) as usize;
    scores
        .iter()
        .enumerate()
        .filter(|(_, &s)| s == best)
        .nth(pick)
        .map_or(0, |(i, _)| i)
}

/// A uniform draw for request `id`'s random tie-break: independent between requests, so that
/// gateways routing side by side break their ties independently, as separate processes do.
pub(crate) fn random_draw(id: u64) -> u64 {
    xxhash_rust::xxh3::xxh3_64(&id.to_le_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tie_goes_to_each_of_the_tied_in_turn_of_the_draw() {
        let scores = [1.0, 3.0, 1.0, 3.0];
        let lowest: Vec<usize> = (0..4).map(|d| best_of(4, d, |w| scores[w], true)).collect();
        assert_eq!(lowest, [0, 2, 0, 2]);
        let highest: Vec<usize> = (0..4)
            .map(|d| best_of(4, d, |w| scores[w], false))
            .collect();
        assert_eq!(highest, [1, 3, 1, 3]);
        // No tie: the draw does not matter.
        assert_eq!(best_of(3, 7, |w| [2.0, 0.5, 1.0][w], true), 1);
        assert_eq!(best_of(0, 7, |_| 0.0, true), 0);
    }

    #[test]
    fn random_draws_spread_a_tie_evenly_and_apart_from_the_request_order() {
        let mut picked = [0u32; 4];
        let mut in_turn = 0;
        for id in 0..4_000u64 {
            let w = best_of(4, random_draw(id), |_| 1.0, true);
            picked[w] += 1;
            in_turn += u32::from(w == id as usize % 4);
        }
        assert!(
            picked.iter().all(|&n| (900..1_100).contains(&n)),
            "{picked:?}"
        );
        // Not the request order's rotation (which gateways side by side would share): about a
        // quarter land where a rotation would.
        assert!((900..1_100).contains(&in_turn), "{in_turn}");
    }
}
