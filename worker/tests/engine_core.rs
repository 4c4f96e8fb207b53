//! The engine core as a step machine: KV accounting under random workloads, step
//! composition, prefix caching, preemption.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvgate_protocol::HashSeed;
use kvgate_worker::backend::sim::SimBackend;
use kvgate_worker::sched::SchedulerConfig;
use kvgate_worker::{Engine, EngineConfig, EngineError, NewRequest, SamplingParams};
use proptest::prelude::*;

mod common;
use common::sim_profile as profile;

fn engine(num_blocks: usize, batched_tokens: usize, max_model_len: usize) -> Engine<SimBackend> {
    let config = EngineConfig {
        block_size: 16,
        num_blocks: Some(num_blocks),
        max_model_len,
        prefix_caching: true,
        scheduler: SchedulerConfig {
            max_num_batched_tokens: batched_tokens,
            max_num_seqs: 64,
            ..Default::default()
        },
        hash_seed: HashSeed::new("test", None, ""),
        eos_token_ids: vec![],
    };
    Engine::new(config, SimBackend::new(profile(), 17, 49152)).unwrap()
}

fn request(id: u64, prompt: Vec<u32>, max_tokens: u32) -> NewRequest {
    NewRequest {
        id,
        prompt,
        params: SamplingParams {
            max_tokens,
            ..Default::default()
        },
        priority: 0,
    }
}

fn run_to_completion(e: &mut Engine<SimBackend>) {
    for _ in 0..100_000 {
        if !e.has_work() {
            return;
        }
        e.step().unwrap();
        e.check_kv().unwrap();
    }
    panic!("engine never drained");
}

#[derive(Debug, Clone)]
enum Op {
    Add {
        prefix: u8,
        len: usize,
        max_tokens: u32,
    },
    Step,
    Abort(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u8..4, 1usize..300, 1u32..40).prop_map(|(prefix, len, max_tokens)| Op::Add {
            prefix,
            len,
            max_tokens
        }),
        Just(Op::Step),
        Just(Op::Step),
        any::<prop::sample::Index>().prop_map(|i| Op::Abort(i.index(1000))),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    /// Random add / step / abort on a pool small enough to force preemption: reference counts
    /// always match the block tables, nothing leaks or is freed twice, and everything is free
    /// at the end.
    #[test]
    fn kv_accounting_survives_any_sequence(ops in prop::collection::vec(op(), 1..120)) {
        let mut e = engine(48, 128, 768);
        let mut next_id = 0u64;
        let mut live: Vec<u64> = Vec::new();
        for op in ops {
            match op {
                Op::Add { prefix, len, max_tokens } => {
                    // Prompts share one of four prefixes, so the prefix cache is exercised.
                    let prompt: Vec<u32> = (0..len as u32).map(|i| if i < 64 { u32::from(prefix) * 1000 + i } else { 50_000 + next_id as u32 + i }).collect();
                    e.add_request(request(next_id, prompt, max_tokens)).unwrap();
                    live.push(next_id);
                    next_id += 1;
                }
                Op::Step => {
                    e.step().unwrap();
                }
                Op::Abort(i) => {
                    if !live.is_empty() {
                        let id = live.remove(i % live.len());
                        e.abort(id);
                    }
                }
            }
            prop_assert!(e.check_kv().is_ok(), "{:?}", e.check_kv());
        }
        run_to_completion(&mut e);
        let s = e.stats();
        prop_assert_eq!(s.kv_blocks_free, s.kv_blocks_total, "blocks leaked");
        prop_assert_eq!((s.running, s.waiting), (0, 0));
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Requests that each grow up to the whole context, on a cache that holds exactly one of
    /// that length: preemption may repeat, but every request finishes with all its tokens.
    #[test]
    fn every_request_finishes_on_a_contended_cache(
        shapes in prop::collection::vec((1usize..320, 1u32..320, 0u8..3), 1..12),
        batched in 16usize..400,
    ) {
        let mut e = engine(20, batched, 320);
        let mut expected = Vec::new();
        for (id, &(len, max_tokens, prefix)) in shapes.iter().enumerate() {
            let len = len.min(319);
            let max_tokens = max_tokens.min((320 - len) as u32);
            let prompt: Vec<u32> = (0..len as u32).map(|i| u32::from(prefix) * 1000 + i % 50 + 17).collect();
            e.add_request(request(id as u64, prompt, max_tokens)).unwrap();
            expected.push(max_tokens as usize);
        }
        let mut produced = vec![0usize; shapes.len()];
        let mut finished = 0;
        for _ in 0..100_000 {
            if !e.has_work() {
                break;
            }
            for t in e.step().unwrap().tokens {
                produced[t.id as usize] += 1;
                finished += usize::from(t.finished.is_some());
            }
        }
        prop_assert!(!e.has_work(), "the engine never drained: {:?}", e.stats());
        prop_assert_eq!(finished, shapes.len());
        prop_assert_eq!(produced, expected);
        prop_assert_eq!(e.stats().kv_blocks_free, 20);
    }
}

#[test]
fn a_long_prompt_is_chunked_and_never_stalls_the_decodes() {
    let mut e = engine(4096, 2048, 40_000);
    for id in 0..16 {
        e.add_request(request(id, vec![id as u32 + 100; 32], 1000))
            .unwrap();
    }
    // Get all 16 into decode.
    loop {
        let out = e.step().unwrap();
        if out.plan.slices.len() == 16 && out.plan.slices.iter().all(|s| s.len == 1) {
            break;
        }
    }
    e.add_request(request(
        99,
        (0..32_768).map(|i| i % 40_000 + 17).collect(),
        4,
    ))
    .unwrap();
    let mut prefill_steps = 0;
    loop {
        let out = e.step().unwrap();
        let decodes = out.plan.slices.iter().filter(|s| s.id < 16).count();
        assert_eq!(decodes, 16, "a step dropped decodes: {:?}", out.plan);
        assert!(out
            .plan
            .slices
            .iter()
            .filter(|s| s.id < 16)
            .all(|s| s.len == 1));
        assert!(out.plan.num_tokens() <= 2048);
        match out.plan.slices.iter().find(|s| s.id == 99) {
            Some(s) if !s.samples => prefill_steps += 1,
            Some(_) => break,
            None => panic!("the long prompt was not scheduled"),
        }
    }
    // 32,768 prompt tokens at 2,048 - 16 per step.
    assert_eq!(prefill_steps, 32_768 / (2048 - 16));
}

#[test]
fn a_shared_prefix_is_served_from_the_cache() {
    let mut e = engine(1024, 4096, 8192);
    let prefix: Vec<u32> = (0..2048).map(|i| i + 17).collect();
    let with_suffix = |s: u32| [prefix.clone(), vec![s, s + 1, s + 2]].concat();
    e.add_request(request(1, with_suffix(30_000), 2)).unwrap();
    run_to_completion(&mut e);
    e.add_request(request(2, with_suffix(40_000), 2)).unwrap();
    let out = e.step().unwrap();
    let slice = out.plan.slices.iter().find(|s| s.id == 2).unwrap();
    assert!(slice.start >= 2032, "prefill not skipped: {slice:?}");
    assert_eq!(slice.start + slice.len, 2051);
    let first = out.tokens.iter().find(|t| t.id == 2).unwrap();
    assert!(first.num_cached_tokens >= 2032, "{first:?}");
    assert_eq!(first.num_cached_tokens, 2048);
}

#[test]
fn a_full_cache_hit_still_computes_the_last_token() {
    let mut e = engine(64, 512, 1024);
    let prompt: Vec<u32> = (0..64).map(|i| i + 17).collect(); // exactly 4 blocks
    e.add_request(request(1, prompt.clone(), 1)).unwrap();
    run_to_completion(&mut e);
    e.add_request(request(2, prompt, 1)).unwrap();
    let out = e.step().unwrap();
    assert_eq!(
        out.plan.slices[0].start, 48,
        "the last block is recomputed for its logits"
    );
    assert_eq!(out.tokens[0].num_cached_tokens, 48);
}

#[test]
fn kv_exhaustion_preempts_and_the_preempted_request_resumes() {
    // 20 blocks of 16: two requests growing to 170 tokens (11 blocks) each cannot both fit.
    let mut e = engine(20, 256, 320);
    e.add_request(request(1, vec![17; 100], 70)).unwrap();
    e.add_request(request(2, vec![18; 100], 70)).unwrap();
    let mut preempted = 0;
    let mut finished = 0;
    for _ in 0..10_000 {
        if !e.has_work() {
            break;
        }
        let out = e.step().unwrap();
        preempted += out.plan.preempted.len();
        finished += out.tokens.iter().filter(|t| t.finished.is_some()).count();
        e.check_kv().unwrap();
    }
    assert!(preempted > 0, "the pool was too small not to preempt");
    assert_eq!(finished, 2);
    assert_eq!(e.stats().kv_blocks_free, 20);
}

#[test]
fn bad_prompts_are_rejected_with_the_limit_and_the_length() {
    let mut e = engine(64, 512, 1024);
    let err = e.add_request(request(1, vec![17; 1024], 1)).unwrap_err();
    assert_eq!(
        err,
        EngineError::PromptTooLong {
            len: 1024,
            limit: 1024
        }
    );
    assert!(err.to_string().contains("1024 tokens"));
    assert_eq!(
        e.add_request(request(2, vec![], 1)).unwrap_err(),
        EngineError::EmptyPrompt
    );
}

#[test]
fn a_cache_smaller_than_the_context_is_refused() {
    // 8 blocks of 16 cannot hold one 1,024-token request: it would be preempted whenever it
    // outgrew the cache, and wait for ever (with every request behind it).
    let config = EngineConfig {
        block_size: 16,
        num_blocks: Some(8),
        max_model_len: 1024,
        prefix_caching: true,
        scheduler: SchedulerConfig::default(),
        hash_seed: HashSeed::new("test", None, ""),
        eos_token_ids: vec![],
    };
    let err = Engine::new(config.clone(), SimBackend::new(profile(), 17, 49152))
        .err()
        .unwrap();
    assert_eq!(
        err,
        EngineError::CacheBelowContext {
            tokens: 128,
            blocks: 8,
            block_size: 16,
            max_model_len: 1024
        }
    );
    assert!(err.to_string().contains("at most 128"), "{err}");
    let exact = EngineConfig {
        max_model_len: 128,
        ..config
    };
    assert!(Engine::new(exact, SimBackend::new(profile(), 17, 49152)).is_ok());
}

#[test]
fn abort_frees_blocks_at_once_and_output_is_deterministic() {
    let mut e = engine(256, 512, 4096);
    e.add_request(request(1, vec![20; 300], 50)).unwrap();
    e.step().unwrap();
    assert!(e.stats().kv_blocks_free < 256);
    assert!(e.abort(1));
    assert_eq!(e.stats().kv_blocks_free, 256);

    // The same prompt alone or among others gives the same tokens.
    let collect = |others: usize| {
        let mut e = engine(1024, 512, 4096);
        for o in 0..others {
            e.add_request(request(100 + o as u64, vec![30 + o as u32; 50], 20))
                .unwrap();
        }
        e.add_request(request(7, vec![21; 70], 20)).unwrap();
        let mut tokens = Vec::new();
        while e.has_work() {
            tokens.extend(
                e.step()
                    .unwrap()
                    .tokens
                    .into_iter()
                    .filter(|t| t.id == 7)
                    .map(|t| t.token),
            );
        }
        tokens
    };
    assert_eq!(collect(0), collect(16));
}

#[test]
fn the_priority_policy_admits_urgent_requests_first() {
    use kvgate_worker::sched::SchedulingPolicy;
    let config = EngineConfig {
        block_size: 16,
        num_blocks: Some(20),
        max_model_len: 320,
        prefix_caching: false,
        scheduler: SchedulerConfig {
            max_num_batched_tokens: 64,
            max_num_seqs: 1,
            policy: SchedulingPolicy::Priority,
            ..Default::default()
        },
        hash_seed: HashSeed::new("test", None, ""),
        eos_token_ids: vec![],
    };
    let mut e = Engine::new(config, SimBackend::new(profile(), 17, 49152)).unwrap();
    let add = |e: &mut Engine<SimBackend>, id: u64, priority: i32| {
        let params = SamplingParams {
            max_tokens: 2,
            ..Default::default()
        };
        e.add_request(NewRequest {
            id,
            prompt: vec![17 + id as u32; 20],
            params,
            priority,
        })
        .unwrap();
    };
    add(&mut e, 1, 5);
    add(&mut e, 2, 0);
    add(&mut e, 3, 5);
    // One sequence at a time: the urgent one first, then the others in arrival order.
    let mut order = Vec::new();
    while e.has_work() {
        for t in e.step().unwrap().tokens {
            if t.finished.is_some() {
                order.push(t.id);
            }
        }
    }
    assert_eq!(order, vec![2, 1, 3]);
}

/// Every token a drained engine produces, in order, with its request.
fn drain(e: &mut Engine<SimBackend>) -> Vec<(u64, u32)> {
    let mut tokens = Vec::new();
    while e.has_work() {
        tokens.extend(e.step().unwrap().tokens.iter().map(|t| (t.id, t.token)));
        e.check_kv().unwrap();
    }
    tokens
}

#[test]
fn a_fork_steps_on_its_own_and_as_the_original_would() {
    // Tight KV so that the run evicts and preempts; a shared prefix so that blocks are shared.
    let mut e = engine(40, 64, 512);
    let shared: Vec<u32> = (100..164).collect();
    for id in 0..6u64 {
        let mut prompt = shared.clone();
        prompt.extend((0..20).map(|t| 1_000 + 37 * id as u32 + t));
        e.add_request(request(id, prompt, 24)).unwrap();
    }
    for _ in 0..5 {
        e.step().unwrap();
    }
    let before = e.stats();
    let mut fork = e.fork();
    fork.check_kv().unwrap();
    let from_fork = drain(&mut fork);
    // The original did not move, and its pool is its own.
    assert_eq!(e.stats(), before);
    e.check_kv().unwrap();
    assert_eq!(drain(&mut e), from_fork);
    assert!(!from_fork.is_empty());
}

/// The sim backend with a device-host link: a prefix evicted to the host tier comes back as
/// cached tokens, the reload priced by its bytes over the link (far less than the prefill it
/// saves, but not free), and no block leaks.
#[test]
fn the_sim_backend_offloads_and_prices_reloads_by_the_link() {
    let mut p = profile();
    p.hardware.host_link_gb_s = Some(1.0);
    let config = EngineConfig {
        block_size: 16,
        num_blocks: Some(140),
        max_model_len: 140 * 16,
        prefix_caching: true,
        scheduler: SchedulerConfig {
            max_num_batched_tokens: 4096,
            max_num_seqs: 4,
            ..Default::default()
        },
        hash_seed: HashSeed::new("test", None, ""),
        eos_token_ids: vec![],
    };
    let mut e = Engine::new(config, SimBackend::new(p.clone(), 17, 49152)).unwrap();
    let cost = e.enable_offload(64 << 20).unwrap();
    assert!(
        cost > 0.0 && cost < 1.0,
        "a reload costs {cost} of a prefill"
    );
    let prompt =
        |seed: u32| -> Vec<u32> { (0..2048).map(|i| 17 + (i * 7 + seed) % 40_000).collect() };
    let first_step = |e: &mut Engine<SimBackend>, id: u64, prompt: Vec<u32>| {
        e.add_request(request(id, prompt, 2)).unwrap();
        let out = e.step().unwrap();
        let cached = out
            .tokens
            .iter()
            .find(|t| t.id == id)
            .map(|t| t.num_cached_tokens);
        run_to_completion(e);
        (out.modelled_duration.unwrap().as_secs_f64(), cached)
    };
    let (cold, _) = first_step(&mut e, 1, prompt(1));
    first_step(&mut e, 2, prompt(2)); // evicts the first prompt's blocks
    let (reloaded, cached) = first_step(&mut e, 3, prompt(1));
    assert_eq!(
        cached,
        Some(2032),
        "127 full blocks, from the pool or the host tier"
    );
    let stats = e.stats();
    let loaded = stats.offload.loaded_blocks;
    assert!(loaded >= 100, "most came from the host tier: {loaded}");
    let copy = loaded as f64 * 16.0 * p.model.kv_bytes_per_token / 1e9;
    assert!(
        reloaded > copy && reloaded < cold,
        "reload step {reloaded} s: the copies ({copy} s) and less than the prefill ({cold} s)"
    );
    assert_eq!(stats.kv_blocks_free, 140);
    let err = e
        .enable_disk_tier(&std::env::temp_dir().join("kvgate-sim-disk"), 1 << 20)
        .unwrap_err();
    assert!(err.contains("without bytes to write"), "{err}");
}

#[test]
fn the_sim_backend_without_a_link_refuses_a_tier() {
    let mut e = engine(64, 512, 1024);
    let err = e.enable_offload(1 << 20).unwrap_err();
    assert!(err.contains("host_link_gb_s"), "{err}");
}
