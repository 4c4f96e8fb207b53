//! The engine thread: owns the engine, takes commands from the HTTP side through a bounded
//! channel, steps while there is work (sleeping out the modelled step time for the sim
//! backend, scaled by `time_scale`), and hands each token to its request's channel. A request
//! whose channel is closed (the client left) is aborted at once.

use super::events::EventLog;
use super::metrics::Metrics;
use crate::backend::Backend;
use crate::engine::{Engine, EngineError, EngineStats, NewRequest, TokenOutput};
use crate::request::{RequestId, RequestMap};
use crate::transfer::TransferBlock;
use kvgate_protocol::kv_events::{KvSnapshot, KV_EVENTS_VERSION};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;
use tokio::sync::{mpsc, oneshot};

pub type WorkerEngine = Engine<Box<dyn Backend + Send>>;

pub enum Command {
    Add {
        request: NewRequest,
        tokens: mpsc::Sender<TokenOutput>,
        reply: oneshot::Sender<Result<(), EngineError>>,
    },
    Abort(RequestId),
    Snapshot(oneshot::Sender<KvSnapshot>),
    /// Forget every cached prefix (an `all_cleared` KV event follows).
    ResetPrefixCache,
    /// A prompt's leading blocks, read out for a decode worker.
    Export {
        prompt: Vec<u32>,
        reply: oneshot::Sender<Vec<TransferBlock>>,
    },
    /// A prompt's block hashes, and whether each is held here.
    Held {
        prompt: Vec<u32>,
        reply: oneshot::Sender<(Vec<u64>, Vec<bool>)>,
    },
    /// Blocks a prefill worker computed, into the host tier.
    Import {
        blocks: Vec<TransferBlock>,
        reply: oneshot::Sender<Result<usize, String>>,
    },
}

/// What the HTTP side reads of the engine.
pub struct Shared {
    pub stats: Mutex<EngineStats>,
    pub events: Mutex<EventLog>,
    pub metrics: Metrics,
}

impl Shared {
    pub fn stats(&self) -> EngineStats {
        self.stats
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// Starts the engine thread and waits until the engine is built on it (its KV blocks are not
/// shared across threads); an engine that cannot be built is the error.
pub fn spawn(
    make_engine: impl FnOnce() -> Result<WorkerEngine, String> + Send + 'static,
    time_scale: f64,
    mut commands: mpsc::Receiver<Command>,
    shared: Arc<Shared>,
) -> Result<std::thread::JoinHandle<()>, String> {
    let (built_tx, built_rx) = std::sync::mpsc::sync_channel(1);
    let thread = std::thread::Builder::new().name("engine".into()).spawn(move || {
        let mut engine = match make_engine() {
            Ok(engine) => {
                let _ = built_tx.send(Ok(()));
                engine
            }
            Err(e) => {
                let _ = built_tx.send(Err(e));
                return;
            }
        };
        let mut outputs: RequestMap<mpsc::Sender<TokenOutput>> = RequestMap::default();
        let mut last_stats = engine.stats();
        loop {
            if !engine.has_work() {
                match commands.blocking_recv() {
                    Some(c) => handle(&mut engine, &mut outputs, &shared, c),
                    None => return,
                }
            }
            while let Ok(c) = commands.try_recv() {
                handle(&mut engine, &mut outputs, &shared, c);
            }
            if engine.has_work() {
                let started = Instant::now();
                match engine.step() {
                    Ok(out) => {
                        // A modelled step's results exist when the step ends, not when it starts.
                        if let Some(modelled) = out.modelled_duration {
                            let target = modelled.mul_f64(time_scale);
                            std::thread::sleep(target.saturating_sub(started.elapsed()));
                        }
                        // Stats and events first: a client that has its token and then asks
                        // `/stats` or the event log sees the step that made it.
                        shared.events.lock().unwrap_or_else(PoisonError::into_inner).publish(out.kv_events);
                        publish_stats(&engine, &shared, &mut last_stats);
                        for token in out.tokens {
                            deliver(&mut engine, &mut outputs, token);
                        }
                    }
                    Err(e) => {
                        // Fail every request in the batch's engine rather than retry forever:
                        // their channels close and their clients get an error.
                        tracing::error!(error = %e, "engine step failed; aborting all requests");
                        for (id, _) in outputs.drain() {
                            engine.abort(id);
                        }
                    }
                }
            }
            publish_stats(&engine, &shared, &mut last_stats);
        }
    });
    let thread = thread.map_err(|e| format!("cannot start the engine thread: {e}"))?;
    match built_rx.recv() {
        Ok(Ok(())) => Ok(thread),
        Ok(Err(e)) => Err(e),
        Err(_) => Err("the engine thread ended while starting".into()),
    }
}

/// Makes the engine's counters visible to `/stats` and `/metrics`.
fn publish_stats(engine: &WorkerEngine, shared: &Shared, last: &mut EngineStats) {
    let stats = engine.stats();
    shared.metrics.record_engine(last, &stats);
    *shared.stats.lock().unwrap_or_else(PoisonError::into_inner) = stats.clone();
    *last = stats;
}

fn handle(
    engine: &mut WorkerEngine,
    outputs: &mut RequestMap<mpsc::Sender<TokenOutput>>,
    shared: &Shared,
    command: Command,
) {
    match command {
        Command::Add {
            request,
            tokens,
            reply,
        } => {
            let id = request.id;
            let result = engine.add_request(request);
            if result.is_ok() {
                outputs.insert(id, tokens);
            }
            let _ = reply.send(result);
        }
        Command::Abort(id) => {
            engine.abort(id);
            outputs.remove(&id);
        }
        Command::ResetPrefixCache => {
            engine.reset_prefix_cache();
            publish_events(engine, shared);
        }
        Command::Export { prompt, reply } => {
            let chain = engine.prompt_chain(&prompt);
            let _ = reply.send(engine.export_prefix(&chain));
        }
        Command::Held { prompt, reply } => {
            let chain = engine.prompt_chain(&prompt);
            let held = engine.held_blocks(&chain);
            let _ = reply.send((chain, held));
        }
        Command::Import { blocks, reply } => {
            let _ = reply.send(engine.import_blocks(blocks));
            publish_events(engine, shared);
        }
        Command::Snapshot(reply) => {
            let seq = shared
                .events
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .last_seq();
            let mut hashes = engine.cached_hashes();
            hashes.sort_unstable();
            let mut host_hashes = engine.offloaded_hashes();
            host_hashes.sort_unstable();
            let mut disk_hashes = engine.disk_hashes();
            disk_hashes.sort_unstable();
            let _ = reply.send(KvSnapshot {
                version: KV_EVENTS_VERSION,
                seq,
                block_size: engine.config().block_size,
                hashes,
                host_hashes,
                disk_hashes,
            });
        }
    }
}

/// KV events made outside a step (a reset, blocks taken in), published at once.
fn publish_events(engine: &mut WorkerEngine, shared: &Shared) {
    let events = engine.take_kv_events();
    shared
        .events
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .publish(events);
}

fn deliver(
    engine: &mut WorkerEngine,
    outputs: &mut RequestMap<mpsc::Sender<TokenOutput>>,
    token: TokenOutput,
) {
    let id = token.id;
    let finished = token.finished.is_some();
    let delivered = outputs
        .get(&id)
        .is_some_and(|tx| tx.try_send(token).is_ok());
    if !delivered {
        // The client went away (or cannot keep up with a channel sized for its whole output).
        engine.abort(id);
        outputs.remove(&id);
    } else if finished {
        outputs.remove(&id);
    }
}
