//! Driving the load: fixed concurrency (closed loop), a Poisson rate or a trace's own
//! timestamps (open loop), until the jobs or the duration run out. Each job's requests go one
//! after another; a multi-turn job's turns carry the previous answers.

use crate::client::{Client, Message};
use crate::record::RequestRecord;
use crate::rng::Rng;
use crate::workload::Job;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Load {
    /// This many jobs in flight at all times.
    Concurrency(usize),
    /// Jobs start as a Poisson process with this rate per second.
    Rate(f64),
    /// Jobs start at their trace timestamps divided by this factor (2: twice as fast).
    Replay { speedup: f64 },
}

impl Load {
    /// When each job starts, in seconds from the start of the run (open loop: the same times
    /// for `kvgate bench` and `kvgate sim` from the same seed); `None` in closed loop.
    pub fn start_times(&self, jobs: &[Job], seed: u64) -> Option<Vec<f64>> {
        match *self {
            Load::Concurrency(_) => None,
            Load::Rate(rate) => {
                let mut rng = Rng::new(seed ^ 0x7261_7465);
                let mut at = 0.0;
                Some(
                    jobs.iter()
                        .map(|_| {
                            at += rng.exponential(1.0 / rate.max(1e-9));
                            at
                        })
                        .collect(),
                )
            }
            Load::Replay { speedup } => Some(
                jobs.iter()
                    .map(|j| j.at.unwrap_or(0.0) / speedup.max(1e-9))
                    .collect(),
            ),
        }
    }
}

pub struct Driver {
    pub client: Client,
    pub model: String,
    /// Requests (in sending order) before this index are warm-up.
    pub warmup: usize,
    /// Stop starting new jobs after this long.
    pub duration: Option<Duration>,
    pub seed: u64,
    pub progress: bool,
}

struct Shared {
    start: Instant,
    next_index: AtomicUsize,
    done: AtomicUsize,
    failed: AtomicUsize,
    records: Mutex<Vec<RequestRecord>>,
}

impl Driver {
    pub async fn run(&self, jobs: Vec<Job>, load: Load) -> Vec<RequestRecord> {
        let total: usize = jobs.iter().map(|j| j.turns.len()).sum();
        let shared = Arc::new(Shared {
            start: Instant::now(),
            next_index: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            failed: AtomicUsize::new(0),
            records: Mutex::new(Vec::with_capacity(total)),
        });
        let progress = self
            .progress
            .then(|| tokio::spawn(report_progress(Arc::clone(&shared), total)));
        let deadline = self.duration.map(|d| shared.start + d);
        let past_deadline = move || deadline.is_some_and(|d| Instant::now() >= d);
        let mut tasks = Vec::new();
        match load {
            Load::Rate(_) | Load::Replay { .. } => {
                let starts = load.start_times(&jobs, self.seed).unwrap_or_default();
                for (job, at) in jobs.into_iter().zip(starts) {
                    tasks.push(self.spawn_at(&shared, job, at));
                }
            }
            Load::Concurrency(n) => {
                let queue = Arc::new(Mutex::new(VecDeque::from(jobs)));
                for _ in 0..n.max(1) {
                    let (queue, shared, me) =
                        (Arc::clone(&queue), Arc::clone(&shared), self.clone_parts());
                    tasks.push(tokio::spawn(async move {
                        loop {
                            if past_deadline() {
                                return;
                            }
                            let job = queue
                                .lock()
                                .unwrap_or_else(PoisonError::into_inner)
                                .pop_front();
                            let Some(job) = job else { return };
                            me.run_job(&shared, job).await;
                        }
                    }));
                }
            }
        }
        for t in tasks {
            let _ = t.await;
        }
        if let Some(p) = progress {
            p.abort();
            if self.progress {
                eprintln!();
            }
        }
        let mut records = std::mem::take(
            &mut *shared
                .records
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        );
        records.sort_by_key(|r| r.index);
        records
    }

    fn spawn_at(&self, shared: &Arc<Shared>, job: Job, at_s: f64) -> tokio::task::JoinHandle<()> {
        let (shared, me) = (Arc::clone(shared), self.clone_parts());
        let deadline = self.duration.map(|d| shared.start + d);
        tokio::spawn(async move {
            let when = shared.start + Duration::from_secs_f64(at_s.max(0.0));
            if deadline.is_some_and(|d| when >= d) {
                return;
            }
            tokio::time::sleep_until(when.into()).await;
            me.run_job(&shared, job).await;
        })
    }

    fn clone_parts(&self) -> JobRunner {
        JobRunner {
            client: self.client.clone(),
            model: self.model.clone(),
            warmup: self.warmup,
        }
    }
}

#[derive(Clone)]
struct JobRunner {
    client: Client,
    model: String,
    warmup: usize,
}

impl JobRunner {
    async fn run_job(&self, shared: &Shared, job: Job) {
        let mut messages: Vec<Message> = Vec::new();
        if let Some(system) = &job.system {
            messages.push(Message {
                role: "system",
                content: system.clone(),
            });
        }
        for turn in job.turns {
            messages.push(Message {
                role: "user",
                content: turn.user,
            });
            let index = shared.next_index.fetch_add(1, Ordering::Relaxed);
            let start_s = shared.start.elapsed().as_secs_f64();
            let out = self
                .client
                .chat(
                    &self.model,
                    &messages,
                    turn.max_tokens,
                    job.session.as_deref(),
                    job.group.as_deref(),
                )
                .await;
            let itl: Vec<f64> = out.content_times.windows(2).map(|w| w[1] - w[0]).collect();
            let record = RequestRecord {
                index,
                warmup: index < self.warmup,
                start_s,
                status: out.status,
                ttft_s: out.content_times.first().copied(),
                e2e_s: out.e2e,
                itl_s: itl,
                prompt_tokens: out.prompt_tokens,
                output_tokens: out.output_tokens,
                cached_tokens: out.cached_tokens,
                replica: out.replica,
                group: job.group.clone(),
                route: out.route,
                error: out.error,
            };
            let failed = !record.ok();
            shared.done.fetch_add(1, Ordering::Relaxed);
            if failed {
                shared.failed.fetch_add(1, Ordering::Relaxed);
            }
            shared
                .records
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(record);
            if failed {
                // A session cannot go on without its answer.
                return;
            }
            messages.push(Message {
                role: "assistant",
                content: out.answer,
            });
        }
    }
}

/// A progress line on stderr, once a second.
async fn report_progress(shared: Arc<Shared>, total: usize) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        let done = shared.done.load(Ordering::Relaxed);
        let failed = shared.failed.load(Ordering::Relaxed);
        let width = 30;
        let filled = (done * width).checked_div(total).unwrap_or(0).min(width);
        let elapsed = shared.start.elapsed().as_secs_f64();
        eprint!(
            "\r[{}{}] {done}/{total} requests, {failed} failed, {:.1} req/s, {elapsed:.0} s   ",
            "#".repeat(filled),
            ".".repeat(width - filled),
            done as f64 / elapsed.max(1e-9),
        );
    }
}
