//! llm-d's inference scheduler with its default scorers.

use super::{best_of, RoutedPrefixes};

/// llm-d's default scheduling profile (its inference-scheduling guide, on the Gateway API
/// Inference Extension's plugins): each worker scores
///
/// - 3 × `prefix-cache-scorer`: the share of the prompt's leading blocks this router sent it
///   before (approximate: it sees no KV events);
/// - 2 × `queue-scorer`: its waiting requests, min-max normalised over the workers (1 for the
///   shortest queue, 0 for the longest; 1 for all when they are equal);
/// - 2 × `kv-cache-utilization-scorer`: 1 − the fraction of its KV cache in use;
///
/// and the highest total wins (`max-score-picker`, ties at random). Queues and KV use are the
/// workers' metrics as last scraped: here, the agents' reports as they reached this gateway.
/// The scorer hashes 64-character blocks; here the prompt's 16-token blocks (see
/// [`RoutedPrefixes`]).
#[derive(Debug, Clone)]
pub struct Llmd {
    pub prefix_weight: f64,
    pub queue_weight: f64,
    pub kv_weight: f64,
    sent: RoutedPrefixes,
}

impl Llmd {
    pub fn new(workers: usize) -> Self {
        Llmd {
            prefix_weight: 3.0,
            queue_weight: 2.0,
            kv_weight: 2.0,
            sent: RoutedPrefixes::new(workers),
        }
    }

    /// The worker for a prompt of `blocks` (chained hashes), given each worker's reported
    /// waiting requests and KV use; a tie goes to one of the tied by `draw` ([`best_of`]).
    pub fn choose(
        &mut self,
        blocks: &[u64],
        waiting: &[u32],
        kv_usage: &[f64],
        draw: u64,
    ) -> usize {
        let matched = self.sent.matched(blocks);
        let (min, max) = (
            waiting.iter().copied().min().unwrap_or(0),
            waiting.iter().copied().max().unwrap_or(0),
        );
        let score = |w: usize| {
            let prefix = if blocks.is_empty() {
                0.0
            } else {
                matched[w] as f64 / blocks.len() as f64
            };
            let queue = if max == min {
                1.0
            } else {
                f64::from(max - waiting[w]) / f64::from(max - min)
            };
            let kv = 1.0 - kv_usage[w].clamp(0.0, 1.0);
            self.prefix_weight * prefix + self.queue_weight * queue + self.kv_weight * kv
        };
        let worker = best_of(matched.len(), draw, score, false);
        self.sent.insert(worker, blocks);
        worker
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefix_wins_until_queue_and_kv_outweigh_it() {
        let mut llmd = Llmd::new(3);
        let prompt: Vec<u64> = (1..=10).collect();
        // Nothing known: a tie, broken by the draw.
        assert_eq!(llmd.choose(&prompt, &[0, 0, 0], &[0.0; 3], 1), 1);
        // Worker 1 was sent the prompt: 3 for its prefix beats equal queues elsewhere.
        assert_eq!(llmd.choose(&prompt, &[0, 0, 0], &[0.0; 3], 0), 1);
        // Its queue the longest and its KV full: 3 + 0 + 0 loses to 0 + 2 + 2.
        assert_eq!(llmd.choose(&prompt, &[0, 4, 0], &[0.0, 1.0, 0.0], 0), 0);
        // A cold prompt: queue and KV alone (2 + 1.8 against 1.33 + 1.8 and 0 + 1).
        let cold: Vec<u64> = (100..110).collect();
        assert_eq!(llmd.choose(&cold, &[3, 0, 1], &[0.5, 0.1, 0.1], 0), 1);
    }
}
