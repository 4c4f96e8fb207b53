//! The offload tier in the engine, on the CPU backend and the default model: a prefix evicted
//! from the KV cache and asked for again is loaded back from host memory (counted as cached),
//! the output and its log-probabilities the same as when it was computed; a tier whose loads
//! cost more than recomputing is not read; nothing leaks either way.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvgate_protocol::kv_events::{KvEvent, Tier};
use kvgate_protocol::HashSeed;
use kvgate_worker::backend::cpu::CpuBackend;
use kvgate_worker::model::ModelFile;
use kvgate_worker::sched::SchedulerConfig;
use kvgate_worker::{Engine, EngineConfig, NewRequest, SamplingParams};

mod common;

const BLOCK: usize = 16;
/// A cache of 20 blocks, all of which the second prompt takes.
const BLOCKS: usize = 20;

fn engine(model: &ModelFile) -> Engine<CpuBackend> {
    let config = EngineConfig {
        block_size: BLOCK,
        num_blocks: Some(BLOCKS),
        max_model_len: BLOCKS * BLOCK,
        prefix_caching: true,
        scheduler: SchedulerConfig {
            max_num_batched_tokens: 512,
            max_num_seqs: 4,
            ..Default::default()
        },
        hash_seed: HashSeed::new("test", None, ""),
        eos_token_ids: Vec::new(),
    };
    let kv_bytes = (BLOCKS + 1) * BLOCK * 30 * 2 * 192 * 4;
    Engine::new(config, common::backend_with_cache(model, 1, kv_bytes)).unwrap()
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| 200 + (i * 31 + seed * 977) % 20_000)
        .collect()
}

/// What one request alone produced.
struct Answer {
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
    cached: usize,
    /// The KV events of its steps.
    events: Vec<KvEvent>,
}

fn answer(e: &mut Engine<CpuBackend>, id: u64, prompt: &[u32]) -> Answer {
    let params = SamplingParams {
        max_tokens: 6,
        temperature: 0.0,
        logprobs: Some(0),
        ..Default::default()
    };
    e.add_request(NewRequest {
        id,
        prompt: prompt.to_vec(),
        params,
        priority: 0,
    })
    .unwrap();
    let mut a = Answer {
        tokens: Vec::new(),
        logprobs: Vec::new(),
        cached: 0,
        events: Vec::new(),
    };
    while e.has_work() {
        let step = e.step().unwrap();
        a.events.extend(step.kv_events);
        for t in step.tokens {
            a.tokens.push(t.token);
            a.logprobs.push(t.logprobs.unwrap().logprob);
            a.cached = t.num_cached_tokens;
        }
    }
    a
}

fn host_events(events: &[KvEvent]) -> (usize, usize) {
    let (mut stored, mut removed) = (0, 0);
    for e in events {
        match e {
            KvEvent::Stored {
                hashes,
                tier: Tier::Host,
                ..
            } => stored += hashes.len(),
            KvEvent::Removed {
                hashes,
                tier: Tier::Host,
            } => removed += hashes.len(),
            _ => {}
        }
    }
    (stored, removed)
}

#[test]
fn an_evicted_prefix_comes_back_from_the_tier_with_the_same_output() {
    let model = ModelFile::open(&common::default_model()).unwrap();
    let mut e = engine(&model);
    e.enable_offload_at(64 << 20, 0.1);
    let (a, b) = (prompt(1, 150), prompt(2, 310));
    let first = answer(&mut e, 1, &a);
    assert_eq!(first.cached, 0);
    let evicting = answer(&mut e, 2, &b);
    let (stored, _) = host_events(&evicting.events);
    assert_eq!(
        stored, 9,
        "the tier's blocks are announced as the host tier's"
    );
    let stats = e.stats();
    assert!(
        stats.offload.offloaded_blocks >= 9,
        "the first prompt's 9 full blocks were evicted to the tier: {:?}",
        stats.offload
    );
    let again = answer(&mut e, 3, &a);
    assert_eq!(
        again.cached,
        9 * BLOCK,
        "all 9 of its full blocks loaded back"
    );
    assert_eq!(again.tokens, first.tokens);
    assert_eq!(
        again.logprobs, first.logprobs,
        "log-probabilities bit for bit"
    );
    let stats = e.stats();
    assert_eq!(stats.offload.loaded_blocks, 9);
    assert!(stats.offload.bytes <= stats.offload.capacity_bytes);
    e.check_kv().unwrap();
    assert_eq!(e.stats().kv_blocks_free, BLOCKS);
}

#[test]
fn a_tier_dearer_than_recomputing_is_not_read() {
    let model = ModelFile::open(&common::default_model()).unwrap();
    let mut e = engine(&model);
    e.enable_offload_at(64 << 20, 1.5);
    let (a, b) = (prompt(1, 150), prompt(2, 310));
    let first = answer(&mut e, 1, &a);
    answer(&mut e, 2, &b);
    let again = answer(&mut e, 3, &a);
    assert_eq!((again.tokens, again.cached), (first.tokens, 0));
    assert_eq!(e.stats().offload.loaded_blocks, 0);
    e.check_kv().unwrap();
}

#[test]
fn a_small_tier_keeps_the_head_of_a_prefix_and_drops_its_tail() {
    let model = ModelFile::open(&common::default_model()).unwrap();
    let mut e = engine(&model);
    let block_bytes = 30 * 2 * BLOCK * 192 * 2;
    e.enable_offload_at(4 * block_bytes, 0.1);
    let (a, b) = (prompt(1, 150), prompt(2, 310));
    let first = answer(&mut e, 1, &a);
    let evicting = answer(&mut e, 2, &b);
    let stats = e.stats();
    assert_eq!(stats.offload.blocks, 4);
    assert_eq!(stats.offload.bytes, 4 * block_bytes as u64);
    let (stored, removed) = host_events(&evicting.events);
    assert_eq!(stored - removed, 4);
    let again = answer(&mut e, 3, &a);
    assert_eq!(again.tokens, first.tokens);
    assert_eq!(
        again.cached,
        4 * BLOCK,
        "the prefix's first 4 blocks, the last to leave the pool"
    );
    e.check_kv().unwrap();
}
