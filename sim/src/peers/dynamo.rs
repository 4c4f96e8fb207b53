//! NVIDIA Dynamo's KV router.

use super::best_of;
use kvgate_policies::{Applied, PreciseIndex, ReplicaId};
use kvgate_protocol::telemetry::KvUpdate;
use std::collections::HashMap;

/// Dynamo's KV router (`--router-mode kv` with its defaults: `kv-overlap-score-weight` 1.0,
/// temperature 0): each worker costs
///
/// `overlap_weight × prefill blocks + decode blocks`
///
/// where the prefill blocks are the prompt tokens it would compute — this prompt less the
/// leading blocks its KV events say it holds, plus the prompts this router sent it that have
/// no first token yet — over the block size, and the decode blocks are the distinct blocks of
/// this router's requests active on it once this one joins (prompt blocks shared by several
/// count once, as Dynamo's active-sequence tracking does; each generated token adds its own).
/// The cheapest wins (ties at random). The router counts active requests itself; its cache
/// view is its own index of the workers' KV events.
#[derive(Debug, Clone)]
pub struct Dynamo {
    pub overlap_weight: f64,
    block_size: usize,
    index: PreciseIndex,
    workers: Vec<Worker>,
    requests: HashMap<u64, Active>,
}

/// What this router has active on one worker.
#[derive(Debug, Clone, Default)]
struct Worker {
    /// Prompt block hash → active requests that hold it.
    blocks: HashMap<u64, u32>,
    /// Prompt tokens past their last full block, and tokens generated, over its requests.
    loose_tokens: u64,
    prefill_tokens: u64,
}

#[derive(Debug, Clone)]
struct Active {
    worker: usize,
    blocks: Vec<u64>,
    loose_tokens: u64,
    prefill_tokens: u64,
}

impl Worker {
    fn decode_blocks(&self, blocks: &[u64], loose_tokens: u64, block_size: u64) -> u64 {
        let new = blocks
            .iter()
            .filter(|h| !self.blocks.contains_key(h))
            .count() as u64;
        self.blocks.len() as u64 + new + (self.loose_tokens + loose_tokens).div_ceil(block_size)
    }
}

impl Dynamo {
    pub fn new(workers: usize, block_size: usize) -> Self {
        Dynamo {
            overlap_weight: 1.0,
            block_size: block_size.max(1),
            index: PreciseIndex::default(),
            workers: vec![Worker::default(); workers],
            requests: HashMap::new(),
        }
    }

    /// Routes request `id` (a prompt of `prompt_len` tokens with these full-block hashes) and
    /// counts it active there; a tie goes to one of the tied by `draw` ([`best_of`]).
    pub fn route(
        &mut self,
        id: u64,
        blocks: &[u64],
        prompt_len: usize,
        now_ms: u64,
        draw: u64,
    ) -> usize {
        let mut held = vec![0.0; self.workers.len()];
        self.index.overlaps(blocks, now_ms, &mut held);
        let bs = self.block_size as u64;
        let loose = (prompt_len - blocks.len() * self.block_size) as u64;
        let new_tokens =
            |w: usize| prompt_len as u64 - (held[w] as u64 * bs).min(prompt_len as u64);
        let cost = |w: usize| {
            let worker = &self.workers[w];
            let prefill = (worker.prefill_tokens + new_tokens(w)) as f64 / bs as f64;
            let decode = worker.decode_blocks(blocks, loose, bs) as f64;
            self.overlap_weight * prefill + decode
        };
        let w = best_of(self.workers.len(), draw, cost, true);
        let active = Active {
            worker: w,
            blocks: blocks.to_vec(),
            loose_tokens: loose,
            prefill_tokens: new_tokens(w),
        };
        let worker = &mut self.workers[w];
        for h in blocks {
            *worker.blocks.entry(*h).or_default() += 1;
        }
        worker.loose_tokens += active.loose_tokens;
        worker.prefill_tokens += active.prefill_tokens;
        self.requests.insert(id, active);
        w
    }

    /// Its prompt is computed: no longer prefill.
    pub fn first_token(&mut self, id: u64) {
        if let Some(r) = self.requests.get_mut(&id) {
            self.workers[r.worker].prefill_tokens -= std::mem::take(&mut r.prefill_tokens);
        }
    }

    /// One more token of it is held.
    pub fn token(&mut self, id: u64) {
        if let Some(r) = self.requests.get_mut(&id) {
            r.loose_tokens += 1;
            self.workers[r.worker].loose_tokens += 1;
        }
    }

    pub fn finished(&mut self, id: u64) {
        let Some(r) = self.requests.remove(&id) else {
            return;
        };
        let worker = &mut self.workers[r.worker];
        worker.prefill_tokens -= r.prefill_tokens;
        worker.loose_tokens -= r.loose_tokens;
        for h in &r.blocks {
            if let Some(n) = worker.blocks.get_mut(h) {
                *n -= 1;
                if *n == 0 {
                    worker.blocks.remove(h);
                }
            }
        }
    }

    pub fn kv_events(&mut self, worker: usize, update: &KvUpdate) -> Applied {
        self.index.apply(ReplicaId(worker as u32), update)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvgate_protocol::kv_events::{KvSnapshot, KV_EVENTS_VERSION};

    fn holds(d: &mut Dynamo, worker: usize, hashes: Vec<u64>) {
        let update = KvUpdate {
            snapshot: Some(KvSnapshot {
                version: KV_EVENTS_VERSION,
                seq: 0,
                block_size: 16,
                hashes,
                host_hashes: Vec::new(),
                disk_hashes: Vec::new(),
            }),
            batches: Vec::new(),
        };
        assert!(!d.kv_events(worker, &update).needs_snapshot);
    }

    #[test]
    fn held_blocks_win_until_the_holder_is_busy() {
        let mut d = Dynamo::new(2, 16);
        let blocks: Vec<u64> = (1..=8).collect();
        holds(&mut d, 1, blocks.clone());
        // Worker 1 holds all 8 blocks of a 128-token prompt: 0 + 8 against 8 + 8.
        assert_eq!(d.route(1, &blocks, 128, 0, 0), 1);
        // The same prompt again: its blocks are active on worker 1 already and count once
        // there (0 + 8 against 8 + 8).
        assert_eq!(d.route(2, &blocks, 128, 0, 0), 1);
        // A cold 512-token prompt: 32 + 32 on worker 0 against 32 + 40 on worker 1.
        let cold: Vec<u64> = (100..132).collect();
        assert_eq!(d.route(3, &cold, 512, 0, 0), 0);
        // Worker 1 generating 200 tokens for each of its two requests: 0 + 8 + 25 there
        // against 40 + 40 on worker 0 (request 3 still prefilling).
        for _ in 0..200 {
            d.token(1);
            d.token(2);
        }
        assert_eq!(d.route(4, &blocks, 128, 0, 0), 1);
        // With 500 more each, worker 1 costs 0 + 8 + 88: the busy holder loses.
        for _ in 0..500 {
            d.token(1);
            d.token(2);
        }
        assert_eq!(d.route(5, &blocks, 128, 0, 0), 0);
        // First tokens clear prefill; finishing clears the rest.
        for id in 1..=5 {
            d.first_token(id);
            d.finished(id);
        }
        assert!(d
            .workers
            .iter()
            .all(|w| w.prefill_tokens == 0 && w.loose_tokens == 0 && w.blocks.is_empty()));
    }
}
