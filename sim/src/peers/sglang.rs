//! SGLang router's `cache_aware`.

use super::{first_min, RoutedPrefixes};

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
    trees: RoutedPrefixes,
}

impl CacheAware {
    pub fn new(workers: usize) -> Self {
        CacheAware {
            cache_threshold: 0.3,
            balance_abs_threshold: 64,
            balance_rel_threshold: 1.5,
            trees: RoutedPrefixes::new(workers),
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
            let matched = self.trees.matched(blocks);
            let (best, run) = matched
                .iter()
                .copied()
                .enumerate()
                .fold((0, 0), |b, (w, r)| if r > b.1 { (w, r) } else { b });
            if !blocks.is_empty() && run as f64 / blocks.len() as f64 > self.cache_threshold {
                best
            } else {
                first_min(self.trees.sizes().iter().copied())
            }
        };
        self.trees.insert(worker, blocks);
        worker
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
