//! The event loop: arrivals, engine steps, agents' reports and their delivery, in virtual
//! microseconds.

mod handover;
mod reports;
mod sent;

use crate::config::SimConfig;
use crate::exchange::Exchange;
use crate::floor::Floor;
use crate::gateway::{Gateway, Incoming, Served};
use crate::replica::Replica;
use crate::routers::{Router, Routes, Turn};
use crate::timeline::Timeline;
use crate::tokens;
use handover::{phase, DECODE, PREFILL};
use kvgate_bench::{Job, Load, RequestRecord};
use kvgate_policies::{ReplicaId, ReplicaSpec, ReportAges};
use kvgate_protocol::telemetry::{KvUpdate, TelemetryReport};
use kvgate_worker::transfer::TransferBlock;
use kvgate_worker::{NewRequest, SamplingParams};
use sent::Sent;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, VecDeque};

/// How far a run has got, for progress bars.
#[derive(Debug, Clone, Copy)]
pub struct Progress {
    pub jobs_done: usize,
    pub jobs: usize,
    pub simulated_s: f64,
    pub events: u64,
}

/// What a run produced.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// Every request, in the order they ended.
    pub records: Vec<RequestRecord>,
    pub simulated_s: f64,
    pub events: u64,
    /// Each replica's load and KV use over time.
    pub timeline: Timeline,
    /// Where each request went.
    pub routes: Routes,
    /// Each request's floor (see [`crate::floor`]) in microseconds, by id.
    pub floors_us: HashMap<u64, u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    /// A job's turn is sent.
    Send {
        job: usize,
    },
    /// A request routed at `Send` reaches its replica.
    Arrive {
        id: u64,
    },
    StepDone {
        replica: usize,
    },
    Report {
        replica: usize,
    },
    /// The oldest report in flight reaches the gateways (every report takes the same delay,
    /// so they arrive in the order they were sent).
    Deliver,
    /// Every replica's load and KV use is recorded.
    Sample,
    /// The oldest decision in flight between gateways reaches the others (all take the same
    /// delay).
    Exchange,
    /// A gateway tells the others the prefill it has queued on each replica.
    Backlog {
        gateway: usize,
    },
    /// A prompt's blocks reach the decode replica of request `id`, which then starts.
    HandOver {
        id: u64,
    },
}

/// A job's progress: its turns so far, as token ids (each turn's prompt and answer).
struct JobProgress {
    history: Vec<u32>,
    turn: usize,
}

struct Sim<'a> {
    config: &'a SimConfig,
    jobs: &'a [Job],
    load: Load,
    served: Served,
    now_us: u64,
    queue: BinaryHeap<Reverse<(u64, u64, Event)>>,
    pushed: u64,
    replicas: Vec<Replica>,
    gateways: Vec<Gateway>,
    progress: Vec<JobProgress>,
    sent: HashMap<u64, Sent>,
    /// Reports sent and not yet delivered, oldest first.
    reports_in_flight: VecDeque<(usize, TelemetryReport, KvUpdate)>,
    /// Decisions and backlogs between gateways, when they exchange them.
    exchange: Option<Exchange>,
    next_request: u64,
    /// Blocks on their way to a decode replica, by the decode leg's id.
    handing_over: HashMap<u64, Vec<TransferBlock>>,
    next_job: usize,
    jobs_done: usize,
    records: Vec<RequestRecord>,
    timeline: Timeline,
    routes: Routes,
    floor: Floor,
}

/// How many events pass between two calls of the progress callback.
const PROGRESS_EVERY: u64 = 1 << 16;

/// Runs `jobs` through a fleet routed by `router`.
pub fn simulate(
    config: &SimConfig,
    jobs: &[Job],
    load: Load,
    router: &Router,
) -> Result<Outcome, String> {
    simulate_with_progress(config, jobs, load, router, &mut |_| {})
}

/// [`simulate`], calling `progress` now and then.
pub fn simulate_with_progress(
    config: &SimConfig,
    jobs: &[Job],
    load: Load,
    router: &Router,
    progress: &mut dyn FnMut(Progress),
) -> Result<Outcome, String> {
    if config.replicas == 0 || config.gateways == 0 {
        return Err("a fleet needs at least one replica and one gateway".into());
    }
    let mut sim = Sim::new(config, jobs, load, router)?;
    sim.run(progress)?;
    Ok(Outcome {
        records: sim.records,
        simulated_s: sim.now_us as f64 / 1e6,
        events: sim.pushed,
        timeline: sim.timeline,
        routes: sim.routes,
        floors_us: sim.floor.floors_us,
    })
}

impl<'a> Sim<'a> {
    fn new(
        config: &'a SimConfig,
        jobs: &'a [Job],
        load: Load,
        router: &Router,
    ) -> Result<Self, String> {
        let seed = config.hash_seed();
        let replicas = (0..config.replicas)
            .map(|i| Ok(Replica::new(format!("sim-{i}"), config.engine(i)?)))
            .collect::<Result<Vec<_>, String>>()?;
        let ages = ReportAges {
            stale_after_ms: 1_000,
            exclude_after_ms: 5_000,
        };
        let specs: Vec<(ReplicaId, ReplicaSpec)> = replicas
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let spec = ReplicaSpec {
                    name: r.name.clone(),
                    url: format!("sim://{}", r.name),
                    models: vec![config.model.clone()],
                    labels: match config.prefill_replicas {
                        0 => BTreeMap::new(),
                        _ => phase(if config.prefills(i) { PREFILL } else { DECODE }),
                    },
                    max_in_flight: None,
                };
                (ReplicaId(i as u32), spec)
            })
            .collect();
        let served = Served {
            model: config.model.clone(),
            seed,
            block_size: config.block_size,
        };
        let gateways = (0..config.gateways)
            .map(|_| {
                // Gateways that exchange decisions know their peers, as `peers:` tells a real one.
                let peers = match config.exchange_delay_ms {
                    Some(_) if config.gateways > 1 => config.gateways as u32 - 1,
                    _ => 0,
                };
                Gateway::new(router, &specs, ages, &served, peers)
            })
            .collect();
        Ok(Sim {
            config,
            jobs,
            load,
            served,
            now_us: 0,
            queue: BinaryHeap::new(),
            pushed: 0,
            timeline: Timeline::new(replicas.iter().map(|r| r.name.clone()).collect()),
            replicas,
            gateways,
            progress: jobs
                .iter()
                .map(|_| JobProgress {
                    history: Vec::new(),
                    turn: 0,
                })
                .collect(),
            sent: HashMap::new(),
            reports_in_flight: VecDeque::new(),
            exchange: config
                .exchange_delay_ms
                .filter(|_| config.gateways > 1)
                .map(|ms| Exchange::new(ms, config.gateways)),
            next_request: 0,
            handing_over: HashMap::new(),
            next_job: 0,
            jobs_done: 0,
            records: Vec::new(),
            routes: Routes::default(),
            floor: Floor::new(config),
        })
    }

    fn push(&mut self, at_us: u64, event: Event) {
        self.pushed += 1;
        self.queue.push(Reverse((at_us, self.pushed, event)));
    }

    fn run(&mut self, progress: &mut dyn FnMut(Progress)) -> Result<(), String> {
        self.schedule_arrivals();
        let interval_us = self.config.report_interval_ms.max(1) * 1_000;
        let n = self.replicas.len() as u64;
        for r in 0..self.replicas.len() {
            // Agents report out of step with one another.
            self.push(interval_us * r as u64 / n, Event::Report { replica: r });
        }
        if self.config.sample_interval_ms > 0 {
            self.push(0, Event::Sample);
        }
        let mut popped = 0u64;
        while let Some(Reverse((at, _, event))) = self.queue.pop() {
            self.now_us = at;
            popped += 1;
            if popped.is_multiple_of(PROGRESS_EVERY) {
                progress(self.progress_now());
            }
            let running = self.jobs_done < self.jobs.len();
            match event {
                Event::Send { job } => self.send(job)?,
                Event::Arrive { id } => self.arrive(id)?,
                Event::StepDone { replica } => self.step_done(replica)?,
                Event::Report { replica } if running => {
                    self.report(replica);
                    self.push(at + interval_us, Event::Report { replica });
                }
                Event::Deliver => self.deliver(),
                Event::Exchange => {
                    if let Some(x) = &mut self.exchange {
                        x.deliver_decision(&mut self.gateways);
                    }
                }
                Event::Backlog { gateway } => {
                    let now = self.now_us;
                    let again = (self.exchange.as_mut())
                        .and_then(|x| x.share_backlog(gateway, now, &mut self.gateways));
                    if let Some(at) = again {
                        self.push(at, Event::Backlog { gateway });
                    }
                }
                Event::HandOver { id } => self.handed_over(id)?,
                Event::Sample if running => {
                    self.sample();
                    self.push(at + self.config.sample_interval_ms * 1_000, Event::Sample);
                }
                Event::Report { .. } | Event::Sample => {}
            }
        }
        progress(self.progress_now());
        Ok(())
    }

    fn progress_now(&self) -> Progress {
        Progress {
            jobs_done: self.jobs_done,
            jobs: self.jobs.len(),
            simulated_s: self.now_us as f64 / 1e6,
            events: self.pushed,
        }
    }

    /// Open loop: every job at its start time, as `kvgate bench` would send it; closed loop:
    /// the first ones.
    fn schedule_arrivals(&mut self) {
        match self.load.start_times(self.jobs, self.config.seed) {
            Some(starts) => {
                for (job, at) in starts.into_iter().enumerate() {
                    self.push((at.max(0.0) * 1e6) as u64, Event::Send { job });
                }
                self.next_job = self.jobs.len();
            }
            None => {
                let Load::Concurrency(n) = self.load else {
                    return;
                };
                for _ in 0..n.max(1).min(self.jobs.len()) {
                    self.start_next_job();
                }
            }
        }
    }

    fn start_next_job(&mut self) {
        if self.next_job < self.jobs.len() {
            let job = self.next_job;
            self.next_job += 1;
            self.push(self.now_us, Event::Send { job });
        }
    }

    /// Sends a job's next turn: its history so far, then this turn's words.
    fn send(&mut self, job: usize) -> Result<(), String> {
        let spec = &self.jobs[job];
        let progress = &mut self.progress[job];
        let Some(turn) = spec.turns.get(progress.turn) else {
            // A job without turns is done at once.
            self.next_turn(job);
            return Ok(());
        };
        if progress.turn == 0 {
            if let Some(system) = &spec.system {
                progress.history = tokens::ids(system);
            }
        }
        let mut prompt = progress.history.clone();
        prompt.extend(tokens::ids(&turn.user));
        let max_tokens = turn.max_tokens;
        let id = self.next_request;
        self.next_request += 1;
        let gateway = job % self.gateways.len();
        let turn = Turn {
            job,
            turn: progress.turn,
        };
        let incoming = Incoming {
            id,
            turn,
            prompt: &prompt,
            job: spec,
            now_us: self.now_us,
        };
        let (replicas, now_us, scale) = (&self.replicas, self.now_us, self.config.time_scale);
        let first_tokens = || {
            replicas
                .iter()
                .map(|r| r.first_token_seconds(new_request(id, &prompt, max_tokens), now_us, scale))
                .collect()
        };
        let disaggregated = self.config.prefill_replicas > 0;
        let decode = disaggregated.then(|| phase(DECODE));
        let replica =
            self.gateways[gateway].route(&incoming, &self.served, &first_tokens, decode.as_ref());
        self.routes.insert(turn, id, replica);
        self.backlog_changed(gateway);
        self.share_decision(gateway);
        let sent = Sent::new(job, gateway, replica, self.now_us, prompt, max_tokens);
        self.sent.insert(id, sent);
        let first = match disaggregated
            && self.sent[&id].prompt.len() >= self.config.pd_min_prompt_tokens
        {
            true => self.prefill_leg(id, gateway, turn),
            false => id,
        };
        let trip_us = self.gateway_delay_us(first);
        self.floor.sent(id, &self.sent[&id].prompt, trip_us);
        match trip_us {
            0 => self.arrive(first),
            delay => {
                self.push(self.now_us + delay, Event::Arrive { id: first });
                Ok(())
            }
        }
    }

    fn gateway_delay_us(&self, id: u64) -> u64 {
        let c = self.config;
        let jitter = match c.gateway_jitter_us {
            0 => 0,
            j => {
                let bytes = [c.jitter_seed.to_le_bytes(), id.to_le_bytes()].concat();
                xxhash_rust::xxh3::xxh3_64(&bytes) % j
            }
        };
        c.gateway_delay_us + jitter
    }

    /// A request reaches its replica's engine.
    fn arrive(&mut self, id: u64) -> Result<(), String> {
        let Some(sent) = self.sent.get(&id) else {
            return Ok(());
        };
        let replica = sent.replica;
        let new = new_request(id, &sent.prompt, sent.max_tokens);
        if let Err(e) = self.replicas[replica].add_request(new) {
            // As a worker would answer: 400, and the job goes on.
            if let Some(sent) = self.sent.remove(&id) {
                self.gateways[sent.gateway].finished(id, replica);
                self.backlog_changed(sent.gateway);
                match sent.hand_to {
                    // The decode replica refuses it the same way.
                    Some(decode) => return self.arrive(decode),
                    None => self.refused(id, &sent, e),
                }
            }
            return Ok(());
        }
        if !self.replicas[replica].is_stepping() {
            self.start_step(replica)?;
        }
        Ok(())
    }

    fn start_step(&mut self, replica: usize) -> Result<(), String> {
        let ends = self.replicas[replica].start_step(self.now_us, self.config.time_scale)?;
        self.push(ends, Event::StepDone { replica });
        Ok(())
    }

    fn step_done(&mut self, replica: usize) -> Result<(), String> {
        let Some((out, more)) = self.replicas[replica].end_step() else {
            return Ok(());
        };
        for token in out.tokens {
            let Some(sent) = self.sent.get_mut(&token.id) else {
                continue;
            };
            let g = sent.gateway;
            let gateway = &mut self.gateways[g];
            let first = sent.first_us.is_none();
            if first {
                sent.first_us = Some(self.now_us);
                gateway.first_token(token.id, self.now_us / 1_000);
            }
            let previous = sent.last_token_us.replace(self.now_us);
            if let Some(last) = previous {
                sent.itl_s.push((self.now_us - last) as f64 / 1e6);
            }
            gateway.token(token.id, self.now_us, previous);
            sent.output.push(token.token);
            if first {
                self.backlog_changed(g);
            }
            if token.finished.is_some() {
                self.finished(token.id, &token)?;
            }
        }
        if more {
            self.start_step(replica)?;
        }
        Ok(())
    }

    /// A request the engine refused (a prompt over the context length).
    fn refused(&mut self, id: u64, sent: &Sent, error: String) {
        self.records.push(RequestRecord {
            index: id as usize,
            warmup: (id as usize) < self.config.warmup,
            start_s: sent.sent_us as f64 / 1e6,
            status: 400,
            ttft_s: None,
            e2e_s: (self.now_us - sent.sent_us) as f64 / 1e6,
            itl_s: Vec::new(),
            prompt_tokens: Some(sent.prompt.len() as u64),
            output_tokens: None,
            cached_tokens: None,
            replica: Some(self.replicas[sent.replica].name.clone()),
            group: self.jobs[sent.job].group.clone(),
            route: None,
            error: Some(error),
        });
        self.next_turn(sent.job);
    }

    /// The job's turn ended: its next turn goes out, or the job is done.
    fn next_turn(&mut self, job: usize) {
        let progress = &mut self.progress[job];
        progress.turn += 1;
        if progress.turn < self.jobs[job].turns.len() {
            self.push(self.now_us, Event::Send { job });
        } else {
            self.jobs_done += 1;
            if matches!(self.load, Load::Concurrency(_)) {
                self.start_next_job();
            }
        }
    }

    fn finished(&mut self, id: u64, token: &kvgate_worker::TokenOutput) -> Result<(), String> {
        let Some(sent) = self.sent.remove(&id) else {
            return Ok(());
        };
        let gateway = &mut self.gateways[sent.gateway];
        if let (Some(first), Some(last)) = (sent.first_us, sent.last_token_us) {
            gateway.fleet.streamed(id, first, last);
        }
        gateway.finished(id, sent.replica);
        self.backlog_changed(sent.gateway);
        if let Some(decode) = sent.hand_to {
            self.hand_over(sent, decode);
            return Ok(());
        }
        let at = |us: u64| us as f64 / 1e6;
        let spec = &self.jobs[sent.job];
        self.records.push(RequestRecord {
            index: id as usize,
            warmup: (id as usize) < self.config.warmup,
            start_s: at(sent.sent_us),
            status: 200,
            ttft_s: sent.first_us.map(|f| at(f - sent.sent_us)),
            e2e_s: at(self.now_us - sent.sent_us),
            itl_s: sent.itl_s,
            prompt_tokens: Some(token.num_prompt_tokens as u64),
            output_tokens: Some(token.num_output_tokens as u64),
            cached_tokens: Some(token.num_cached_tokens as u64),
            replica: Some(self.replicas[sent.replica].name.clone()),
            group: spec.group.clone(),
            route: None,
            error: None,
        });
        self.floor.answered(&sent.prompt, &sent.output);
        let progress = &mut self.progress[sent.job];
        progress.history = sent.prompt;
        if self.config.answers_round_trip {
            progress.history.extend(sent.output);
        } else {
            progress.history.extend(tokens::retokenized(&sent.output));
        }
        self.next_turn(sent.job);
        Ok(())
    }

    fn sample(&mut self) {
        let t_s = self.now_us as f64 / 1e6;
        for (i, r) in self.replicas.iter().enumerate() {
            self.timeline.push(r.sample(t_s, i as u32));
        }
    }
}

/// A request as the simulated clients send it: the bench's `ignore_eos`, so it generates
/// exactly `max_tokens`.
fn new_request(id: u64, prompt: &[u32], max_tokens: u32) -> NewRequest {
    NewRequest {
        id,
        prompt: prompt.to_vec(),
        params: SamplingParams {
            max_tokens,
            ignore_eos: true,
            ..Default::default()
        },
        priority: 0,
    }
}
