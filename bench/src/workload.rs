//! Workloads: what to send. Each becomes a list of jobs; a job is one request, or a multi-turn
//! session's turns sent one after another (each turn carrying the previous answers).

use crate::rng::Rng;
use crate::text::{seed, words};
use crate::traces;
use std::path::PathBuf;

#[derive(Debug, Clone, PartialEq)]
pub enum Workload {
    /// Independent prompts with log-normal lengths (mean, sigma of the underlying normal).
    Random {
        input_mean: f64,
        input_sigma: f64,
        output_mean: f64,
        output_sigma: f64,
    },
    /// `groups` system prompts, each shared by `prompts_per_group` questions, in random order.
    SharedPrefix {
        groups: usize,
        prompts_per_group: usize,
        system_len: usize,
        question_len: usize,
        output_len: u32,
    },
    /// Conversations of `turns` turns; each turn sends the whole history so far.
    MultiTurn {
        turns: usize,
        system_len: usize,
        turn_len: usize,
        output_len: u32,
    },
    /// A Mooncake trace: each `hash_id` becomes a distinct `block_tokens`-token block of text
    /// (512 as in the trace; fewer scale prompt lengths down alike, outputs unchanged).
    Mooncake { path: PathBuf, block_tokens: usize },
    /// An Azure LLM inference trace (lengths and timestamps, no shared prefixes).
    Azure { path: PathBuf },
}

/// One turn of a job.
#[derive(Debug, Clone, PartialEq)]
pub struct Turn {
    pub user: String,
    pub max_tokens: u32,
}

/// Requests sent one after another.
#[derive(Debug, Clone, PartialEq)]
pub struct Job {
    /// Seconds after the start, when replaying a trace's timestamps.
    pub at: Option<f64>,
    /// Sent as `x-session-id` (multi-turn sessions).
    pub session: Option<String>,
    /// The prefix group it belongs to (a shared-prefix group, a trace's first block), sent in
    /// the `--group-header` when one is named: routers that hash a header (vLLM's
    /// `consistent_hash`) get a key that follows the prefix.
    pub group: Option<String>,
    pub system: Option<String>,
    pub turns: Vec<Turn>,
}

impl Job {
    fn single(at: Option<f64>, system: Option<String>, user: String, max_tokens: u32) -> Job {
        Job {
            at,
            session: None,
            group: None,
            system,
            turns: vec![Turn { user, max_tokens }],
        }
    }
}

impl Workload {
    /// Parses `random`, `shared-prefix`, `multi-turn`, `mooncake:FILE`, `azure:FILE`, with the
    /// shape parameters given beside it.
    pub fn name(&self) -> String {
        match self {
            Workload::Random { .. } => "random".into(),
            Workload::SharedPrefix { .. } => "shared-prefix".into(),
            Workload::MultiTurn { .. } => "multi-turn".into(),
            Workload::Mooncake { path, .. } => format!("mooncake:{}", path.display()),
            Workload::Azure { path } => format!("azure:{}", path.display()),
        }
    }

    /// Whether jobs carry timestamps to replay.
    pub fn is_trace(&self) -> bool {
        matches!(self, Workload::Mooncake { .. } | Workload::Azure { .. })
    }

    /// The jobs of at most `requests` requests, from `seed`.
    pub fn jobs(&self, requests: usize, seed_value: u64) -> Result<Vec<Job>, String> {
        let mut rng = Rng::new(seed_value);
        let length = |rng: &mut Rng, mean: f64, sigma: f64| -> usize {
            if sigma <= 0.0 {
                mean.round().max(1.0) as usize
            } else {
                rng.log_normal(mean, sigma).round().max(1.0) as usize
            }
        };
        Ok(match self {
            Workload::Random {
                input_mean,
                input_sigma,
                output_mean,
                output_sigma,
            } => (0..requests)
                .map(|i| {
                    let input = length(&mut rng, *input_mean, *input_sigma);
                    let output = length(&mut rng, *output_mean, *output_sigma);
                    let user = words(seed(&[seed_value, 1, i as u64]), input);
                    Job::single(None, None, user, output as u32)
                })
                .collect(),
            Workload::SharedPrefix {
                groups,
                prompts_per_group,
                system_len,
                question_len,
                output_len,
            } => {
                let mut jobs: Vec<Job> = (0..*groups)
                    .flat_map(|g| {
                        let system = words(seed(&[seed_value, 2, g as u64]), *system_len);
                        (0..*prompts_per_group).map(move |q| {
                            let user =
                                words(seed(&[seed_value, 3, g as u64, q as u64]), *question_len);
                            Job {
                                group: Some(format!("group-{g}")),
                                ..Job::single(None, Some(system.clone()), user, *output_len)
                            }
                        })
                    })
                    .collect();
                rng.shuffle(&mut jobs);
                jobs.truncate(requests);
                jobs
            }
            Workload::MultiTurn {
                turns,
                system_len,
                turn_len,
                output_len,
            } => {
                let turns = (*turns).max(1);
                let sessions = requests.div_ceil(turns);
                let system = words(seed(&[seed_value, 4]), *system_len);
                (0..sessions)
                    .map(|s| Job {
                        at: None,
                        session: Some(format!("bench-session-{seed_value}-{s}")),
                        group: Some(format!("bench-session-{seed_value}-{s}")),
                        system: (*system_len > 0).then(|| system.clone()),
                        turns: (0..turns.min(requests - s * turns))
                            .map(|t| Turn {
                                user: words(seed(&[seed_value, 5, s as u64, t as u64]), *turn_len),
                                max_tokens: *output_len,
                            })
                            .collect(),
                    })
                    .collect()
            }
            Workload::Mooncake { path, block_tokens } => traces::mooncake(path, requests)?
                .into_iter()
                .map(|r| {
                    let mut user = String::new();
                    for &h in &r.hash_ids {
                        user.push_str(&words(seed(&[0x6d6f_6f6e, h]), *block_tokens));
                    }
                    // Lengths scale with the block size (the trace's blocks are 512 tokens);
                    // the last block may be partial.
                    let scaled = (r.input_length * block_tokens).div_ceil(512).max(1);
                    let keep = scaled.min(r.hash_ids.len() * block_tokens);
                    let cut = user
                        .match_indices(' ')
                        .nth(keep)
                        .map_or(user.len(), |(i, _)| i);
                    user.truncate(cut);
                    Job {
                        group: r.hash_ids.first().map(|h| format!("block-{h}")),
                        ..Job::single(Some(r.at_s), None, user, r.output_length.max(1))
                    }
                })
                .collect(),
            Workload::Azure { path } => traces::azure(path, requests)?
                .into_iter()
                .enumerate()
                .map(|(i, r)| {
                    let user = words(seed(&[seed_value, 6, i as u64]), r.input_length.max(1));
                    Job::single(Some(r.at_s), None, user, r.output_length.max(1))
                })
                .collect(),
        })
    }

    /// The share of prompt tokens a single replica with an unbounded cache could reuse (the
    /// reference for the measured cached-token ratio), in this workload's own terms, over the
    /// requests after the first `warmup` (whose prefixes count as already seen, as they are
    /// for the measured requests).
    pub fn ideal_cached_ratio(&self, jobs: &[Job], warmup: usize) -> Option<f64> {
        match self {
            Workload::SharedPrefix {
                system_len,
                question_len,
                ..
            } => {
                let mut seen = std::collections::HashSet::new();
                let (mut reused, mut total) = (0usize, 0usize);
                for (i, job) in jobs.iter().enumerate() {
                    let fresh = seen.insert(job.group.clone());
                    if i >= warmup {
                        total += system_len + question_len;
                        reused += if fresh { 0 } else { *system_len };
                    }
                }
                (total > 0).then(|| reused as f64 / total as f64)
            }
            Workload::Mooncake { path, .. } => {
                let trace = traces::mooncake(path, jobs.len()).ok()?;
                Some(traces::mooncake_ideal_reuse(&trace, warmup))
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_prefix_groups_share_their_system_prompt() -> Result<(), String> {
        let w = Workload::SharedPrefix {
            groups: 3,
            prompts_per_group: 4,
            system_len: 50,
            question_len: 5,
            output_len: 8,
        };
        let jobs = w.jobs(100, 1)?;
        assert_eq!(jobs.len(), 12);
        let systems: std::collections::BTreeSet<_> =
            jobs.iter().map(|j| j.system.clone()).collect();
        assert_eq!(systems.len(), 3);
        let pairs: std::collections::BTreeSet<_> = jobs
            .iter()
            .map(|j| (j.system.clone(), j.group.clone()))
            .collect();
        assert_eq!(pairs.len(), 3, "one group key per system prompt");
        assert_eq!(jobs, w.jobs(100, 1)?, "deterministic");
        let ideal = w.ideal_cached_ratio(&jobs, 0).unwrap_or(0.0);
        assert!((ideal - 9.0 * 50.0 / (12.0 * 55.0)).abs() < 1e-9, "{ideal}");
        // After a warm-up that saw every group, every measured request could reuse its prefix.
        let first_all = 1
            + (0..jobs.len())
                .find(|&i| {
                    jobs[..=i]
                        .iter()
                        .map(|j| &j.group)
                        .collect::<std::collections::BTreeSet<_>>()
                        .len()
                        == 3
                })
                .unwrap_or(0);
        let ideal = w.ideal_cached_ratio(&jobs, first_all).unwrap_or(0.0);
        assert!((ideal - 50.0 / 55.0).abs() < 1e-9, "{ideal}");
        Ok(())
    }

    #[test]
    fn multi_turn_splits_requests_into_sessions() -> Result<(), String> {
        let w = Workload::MultiTurn {
            turns: 4,
            system_len: 10,
            turn_len: 6,
            output_len: 8,
        };
        let jobs = w.jobs(10, 1)?;
        let turns: Vec<usize> = jobs.iter().map(|j| j.turns.len()).collect();
        assert_eq!(turns, vec![4, 4, 2]);
        assert!(jobs.iter().all(|j| j.session.is_some()));
        Ok(())
    }
}
