//! The TTFT no router can beat on a run: each request alone on an idle replica that holds
//! every block an earlier request carried (each prompt from when it was sent, and its answer
//! once it came back), so with ideal reuse and no queue. What is left is the request's own
//! trip to its replica and its prefill: in as few steps as the scheduler's budget allows, no
//! faster than the profile lets any split of it go (`Profile::prefill_floor_seconds`; a
//! prompt computed in one step takes exactly that step). Every run checks that no request's
//! TTFT lies below its floor ([`below_floor`]).

use crate::config::SimConfig;
use crate::replica::step_us;
use kvgate_bench::RequestRecord;
use kvgate_protocol::{block_hashes, HashSeed};
use kvgate_worker::backend::profile::Profile;
use kvgate_worker::sched::SchedulerConfig;
use std::collections::{HashMap, HashSet};
use std::time::Duration;

pub(crate) struct Floor {
    seed: HashSeed,
    block_size: usize,
    scheduler: SchedulerConfig,
    profile: Profile,
    time_scale: f64,
    /// Every full block's hash that a request sent so far carried.
    carried: HashSet<u64>,
    /// Each request's floor in microseconds, by id.
    pub floors_us: HashMap<u64, u64>,
}

impl Floor {
    pub fn new(config: &SimConfig) -> Floor {
        Floor {
            seed: config.hash_seed(),
            block_size: config.block_size,
            scheduler: config.scheduler(),
            profile: config.profile.clone(),
            time_scale: config.time_scale,
            carried: HashSet::new(),
            floors_us: HashMap::new(),
        }
    }

    /// Request `id` is sent with `prompt`, reaching its replica `trip_us` later.
    pub fn sent(&mut self, id: u64, prompt: &[u32], trip_us: u64) {
        let hashes = block_hashes(self.seed, prompt, self.block_size);
        let floor = trip_us + self.prefill_us(prompt.len(), &hashes);
        self.floors_us.insert(id, floor);
        self.carried.extend(hashes);
    }

    /// A request's prompt and answer, now that it came back (but the answer's last token,
    /// which no step computed).
    pub fn answered(&mut self, prompt: &[u32], output: &[u32]) {
        let computed = &output[..output.len().saturating_sub(1)];
        let tokens = [prompt, computed].concat();
        self.carried
            .extend(block_hashes(self.seed, &tokens, self.block_size));
    }

    /// The prefill of a prompt of `prompt_len` tokens (its full blocks' `hashes`) on the ideal
    /// replica, no faster than any schedule could make it (the engine reuses whole leading
    /// blocks, never the last token's).
    fn prefill_us(&self, prompt_len: usize, hashes: &[u64]) -> u64 {
        let reusable = prompt_len.saturating_sub(1) / self.block_size.max(1);
        let held = hashes
            .iter()
            .take(reusable)
            .take_while(|h| self.carried.contains(h))
            .count();
        let (start, len) = (held * self.block_size, prompt_len - held * self.block_size);
        if len == 0 {
            return 0;
        }
        let per_step = self
            .scheduler
            .chunk(len, self.scheduler.max_num_batched_tokens)
            .max(1);
        let steps = len.div_ceil(per_step);
        let seconds = self.profile.prefill_floor_seconds(start, len, per_step);
        let us = step_us(Some(Duration::from_secs_f64(seconds)), self.time_scale);
        // Each step's time is rounded down to a microsecond on its own.
        match steps {
            1 => us,
            _ => us.saturating_sub(steps as u64),
        }
    }
}

/// The run's answered requests with their floors as their TTFTs (for the floor's figures over
/// the same requests as the run's).
pub fn floor_records(
    records: &[RequestRecord],
    floors_us: &HashMap<u64, u64>,
) -> Vec<RequestRecord> {
    records
        .iter()
        .filter(|r| r.ttft_s.is_some())
        .filter_map(|r| {
            let floor = floors_us.get(&(r.index as u64))?;
            Some(RequestRecord {
                ttft_s: Some(*floor as f64 / 1e6),
                ..r.clone()
            })
        })
        .collect()
}

/// Every request whose TTFT lies below its floor, as text (the model of the floor is then
/// wrong, and so is anything compared with it).
pub fn below_floor(records: &[RequestRecord], floors_us: &HashMap<u64, u64>) -> Vec<String> {
    records
        .iter()
        .filter_map(|r| {
            let ttft_us = (r.ttft_s? * 1e6).round() as u64;
            let floor = *floors_us.get(&(r.index as u64))?;
            (ttft_us < floor).then(|| {
                format!(
                    "request {}: TTFT {ttft_us} us < its floor {floor} us",
                    r.index
                )
            })
        })
        .collect()
}
