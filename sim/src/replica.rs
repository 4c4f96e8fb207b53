//! One simulated replica: the worker's engine on the sim backend, the step under way, and its
//! agent — the KV events it has yet to report, and the reports it sends.

use crate::lookahead;
use crate::timeline::ReplicaSample;
use kvgate_protocol::kv_events::{KvEventBatch, KvSnapshot, KV_EVENTS_VERSION};
use kvgate_protocol::telemetry::{EngineLoad, KvUpdate, TelemetryReport, TELEMETRY_VERSION};
use kvgate_worker::backend::sim::SimBackend;
use kvgate_worker::transfer::TransferBlock;
use kvgate_worker::{Engine, NewRequest, StepOutput};
use std::time::Duration;

/// A step's length on the fleet's clock: its modelled duration times `time_scale`, in whole
/// microseconds (at least one, so that time moves).
pub(crate) fn step_us(modelled: Option<Duration>, time_scale: f64) -> u64 {
    modelled.map_or(1, |d| (d.mul_f64(time_scale).as_micros() as u64).max(1))
}

pub(crate) struct Replica {
    pub name: String,
    engine: Engine<SimBackend>,
    /// The step under way: its results count when it ends.
    step: Option<StepOutput>,
    busy_until_us: u64,
    /// KV-event batches since the last report, and the last one's sequence number.
    batches: Vec<KvEventBatch>,
    seq: u64,
    reports: u64,
    /// A gateway could not apply the events in sequence: the next report carries a snapshot.
    pub needs_snapshot: bool,
}

impl Replica {
    pub fn new(name: String, engine: Engine<SimBackend>) -> Self {
        Replica {
            name,
            engine,
            step: None,
            busy_until_us: 0,
            batches: Vec::new(),
            seq: 0,
            reports: 0,
            needs_snapshot: true,
        }
    }

    pub fn is_stepping(&self) -> bool {
        self.step.is_some()
    }

    pub fn add_request(&mut self, request: NewRequest) -> Result<(), String> {
        self.engine.add_request(request).map_err(|e| e.to_string())
    }

    /// A prefill replica's side of a hand-over: the blocks of `prompt` it holds, read out.
    pub fn export_prompt(&mut self, prompt: &[u32]) -> Vec<TransferBlock> {
        let chain = self.engine.prompt_chain(prompt);
        self.engine.export_prefix(&chain)
    }

    /// A decode replica's side: the blocks a prefill replica computed, into its host tier.
    pub fn import_blocks(&mut self, blocks: Vec<TransferBlock>) -> Result<usize, String> {
        self.engine.import_blocks(blocks)
    }

    /// Computes the next step now; its results count when it ends, at the returned time (each
    /// modelled duration times `time_scale`).
    pub fn start_step(&mut self, now_us: u64, time_scale: f64) -> Result<u64, String> {
        let out = self.engine.step().map_err(|e| e.to_string())?;
        let took = step_us(out.modelled_duration, time_scale);
        self.step = Some(out);
        self.busy_until_us = now_us + took;
        Ok(self.busy_until_us)
    }

    /// The step that just ended (its KV events kept for the next report), and whether the
    /// engine has more to do.
    pub fn end_step(&mut self) -> Option<(StepOutput, bool)> {
        let mut out = self.step.take()?;
        // The step's own events, then any the engine produced since.
        let mut events = std::mem::take(&mut out.kv_events);
        events.extend(self.engine.take_kv_events());
        if !events.is_empty() {
            self.seq += 1;
            self.batches.push(KvEventBatch {
                version: KV_EVENTS_VERSION,
                seq: self.seq,
                events,
            });
        }
        Some((out, self.engine.has_work()))
    }

    /// Modelled seconds until `request`'s first token were it sent here at `now_us` (the
    /// look-ahead).
    pub fn first_token_seconds(
        &self,
        request: NewRequest,
        now_us: u64,
        time_scale: f64,
    ) -> Option<f64> {
        let busy_s = self.busy_until_us.saturating_sub(now_us) as f64 / 1e6 / time_scale;
        lookahead::first_token_seconds(&self.engine, request, busy_s)
    }

    /// Its agent's report: the engine's load now, and the KV events since the last one (or a
    /// snapshot, first and whenever a gateway lost the sequence).
    pub fn report(&mut self, model: &str, block_size: usize) -> (TelemetryReport, KvUpdate) {
        let stats = self.engine.stats();
        self.reports += 1;
        let report = TelemetryReport {
            version: TELEMETRY_VERSION,
            replica: self.name.clone(),
            url: format!("sim://{}", self.name),
            instance: 1,
            seq: self.reports,
            healthy: true,
            load: EngineLoad {
                models: vec![model.to_string()],
                running: stats.running as u32,
                waiting: stats.waiting as u32,
                kv_blocks_total: stats.kv_blocks_total as u64,
                kv_blocks_used: stats.kv_blocks_total.saturating_sub(stats.kv_blocks_free) as u64,
                block_size: stats.block_size as u32,
                ..Default::default()
            },
            ..Default::default()
        };
        let update = if std::mem::take(&mut self.needs_snapshot) {
            self.batches.clear();
            KvUpdate {
                snapshot: Some(KvSnapshot {
                    version: KV_EVENTS_VERSION,
                    seq: self.seq,
                    block_size,
                    hashes: self.engine.cached_hashes(),
                    host_hashes: Vec::new(),
                    disk_hashes: Vec::new(),
                }),
                batches: Vec::new(),
            }
        } else {
            KvUpdate {
                snapshot: None,
                batches: std::mem::take(&mut self.batches),
            }
        };
        (report, update)
    }

    /// Its load and KV use now, for the timeline.
    pub fn sample(&self, t_s: f64, index: u32) -> ReplicaSample {
        let stats = self.engine.stats();
        ReplicaSample {
            t_s,
            replica: index,
            running: stats.running as u32,
            waiting: stats.waiting as u32,
            kv_used: stats.kv_blocks_total.saturating_sub(stats.kv_blocks_free) as u32,
            kv_total: stats.kv_blocks_total as u32,
        }
    }
}
