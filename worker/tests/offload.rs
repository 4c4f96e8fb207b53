//! The offload tier in the engine, on the CPU backend and the default model: a prefix evicted
//! from the KV cache and asked for again is loaded back from host memory (counted as cached),
//! the output and its log-probabilities the same as when it was computed; a tier whose loads
//! cost more than recomputing is not read; blocks handed from one engine to another (prefill /
//! decode) arrive byte for byte; nothing leaks either way.
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

/// A new directory, removed with what is in it when dropped.
fn disk_dir(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("kvgate-offload-{name}-"))
        .tempdir()
        .unwrap()
}

/// The disk tier's block files in `dir`.
fn block_files(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|f| Some(f.ok()?.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "kvblock"))
        .collect()
}

/// A host tier of 4 blocks over a disk tier: the prefix's head stays in memory, its tail is
/// written to disk.
fn tiered_engine(model: &ModelFile, dir: &std::path::Path) -> Engine<CpuBackend> {
    let mut e = engine(model);
    let block_bytes = 30 * 2 * BLOCK * 192 * 2;
    e.enable_offload_at(4 * block_bytes, 0.1);
    let cost = e.enable_disk_tier(dir, 64 << 20).unwrap();
    assert!(
        cost < 1.0,
        "reading a block back costs {cost} of computing it"
    );
    e
}

#[test]
fn a_prefix_spread_over_host_and_disk_comes_back_whole_with_the_same_output() {
    let model = ModelFile::open(&common::default_model()).unwrap();
    let dir = disk_dir("spread");
    let dir = dir.path();
    let mut e = tiered_engine(&model, dir);
    let (a, b) = (prompt(1, 150), prompt(2, 310));
    let first = answer(&mut e, 1, &a);
    let evicting = answer(&mut e, 2, &b);
    let disk_stored = evicting
        .events
        .iter()
        .filter_map(|ev| match ev {
            KvEvent::Stored {
                hashes,
                tier: Tier::Disk,
                ..
            } => Some(hashes.len()),
            _ => None,
        })
        .sum::<usize>();
    assert_eq!(disk_stored, 5, "the 5 blocks the host tier evicted");
    assert_eq!(e.disk_hashes().len(), 5);
    let again = answer(&mut e, 3, &a);
    assert_eq!(again.cached, 9 * BLOCK, "4 blocks from memory, 5 from disk");
    assert_eq!(again.tokens, first.tokens);
    assert_eq!(again.logprobs, first.logprobs, "bit for bit");
    let stats = e.stats().offload;
    let disk = stats.disk.clone().unwrap();
    assert_eq!(
        (stats.loaded_blocks, disk.loaded_blocks),
        (4, 5),
        "{stats:?}"
    );
    assert_eq!(disk.failed_reads, 0);
    e.check_kv().unwrap();
    drop(e);
    let left = block_files(dir);
    assert!(
        left.is_empty(),
        "a stopped engine leaves no block files: {left:?}"
    );
}

#[test]
fn a_corrupted_disk_block_is_computed_again_not_served() {
    let model = ModelFile::open(&common::default_model()).unwrap();
    let dir = disk_dir("corrupt");
    let dir = dir.path();
    let mut e = tiered_engine(&model, dir);
    let (a, b) = (prompt(1, 150), prompt(2, 310));
    let first = answer(&mut e, 1, &a);
    answer(&mut e, 2, &b);
    // Flip one byte of every block file's K/V (past the 20-byte header).
    for path in block_files(dir) {
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[100] ^= 0x40;
        std::fs::write(&path, bytes).unwrap();
    }
    let again = answer(&mut e, 3, &a);
    assert_eq!(
        again.cached,
        4 * BLOCK,
        "the host tier's 4 blocks; the rest computed"
    );
    assert_eq!(again.tokens, first.tokens);
    assert_eq!(again.logprobs, first.logprobs);
    let disk = e.stats().offload.disk.clone().unwrap();
    assert_eq!((disk.loaded_blocks, disk.failed_reads), (0, 1), "{disk:?}");
    let removed = again.events.iter().any(|ev| {
        matches!(
            ev,
            KvEvent::Removed {
                tier: Tier::Disk,
                ..
            }
        )
    });
    assert!(removed, "the dropped block is announced as gone");
    e.check_kv().unwrap();
}

#[test]
fn a_disk_tier_needs_the_host_tier_and_a_directory_of_its_own() {
    let model = ModelFile::open(&common::default_model()).unwrap();
    let dir = disk_dir("refusals");
    let dir = dir.path();
    let err = engine(&model).enable_disk_tier(dir, 1 << 20).unwrap_err();
    assert!(err.contains("--kv-offload-mib"), "{err}");
    let _first = tiered_engine(&model, dir);
    let mut second = engine(&model);
    second.enable_offload_at(1 << 20, 0.1);
    let err = second.enable_disk_tier(dir, 1 << 20).unwrap_err();
    assert!(err.contains("in use by another worker"), "{err}");
}

/// Prefill/decode's hand-over between two engines: the blocks one computed, exported and
/// imported into the other's host tier, are loaded there byte for byte, and the second
/// answers as the first did; neither leaks a block.
#[test]
fn blocks_handed_to_another_engine_arrive_byte_for_byte() {
    let model = ModelFile::open(&common::default_model()).unwrap();
    let (mut prefill, mut decode) = (engine(&model), engine(&model));
    decode.enable_offload_at(64 << 20, 0.1);
    let a = prompt(1, 150);
    let computed = answer(&mut prefill, 1, &a);
    let chain = prefill.prompt_chain(&a);
    assert_eq!(chain.len(), 9);
    let sent = prefill.export_prefix(&chain);
    assert_eq!(sent.len(), 9);
    assert_eq!(decode.held_blocks(&chain), vec![false; 9]);
    assert_eq!(decode.import_blocks(sent.clone()).unwrap(), 9);
    assert_eq!(decode.held_blocks(&chain), vec![true; 9]);
    let handed = answer(&mut decode, 1, &a);
    assert_eq!(
        handed.cached,
        9 * BLOCK,
        "every block loaded, none computed"
    );
    assert_eq!(handed.tokens, computed.tokens);
    assert_eq!(
        handed.logprobs, computed.logprobs,
        "log-probabilities bit for bit"
    );
    assert_eq!(decode.stats().offload.imported_blocks, 9);
    let back = decode.export_prefix(&chain);
    assert_eq!(
        back, sent,
        "the K/V the decode engine holds is the K/V sent"
    );
    let mut wrong_size = sent[0].clone();
    wrong_size.data = vec![0u8; 3].into();
    assert_eq!(decode.import_blocks(vec![wrong_size]).unwrap(), 0);
    for e in [&prefill, &decode] {
        e.check_kv().unwrap();
        assert_eq!(e.stats().kv_blocks_free, BLOCKS);
    }
    let mut no_tier = engine(&model);
    assert!(
        no_tier.import_blocks(sent).is_err(),
        "a worker without a host tier takes none"
    );
}
