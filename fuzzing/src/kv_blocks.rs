//! The worker's KV blocks under any sequence of requests added, steps and aborts, on a cache
//! small enough to preempt: every block's reference count matches the block tables after every
//! operation, and when the engine has drained every block is free and every request finished.

use arbitrary::{Arbitrary, Unstructured};
use kvgate_protocol::HashSeed;
use kvgate_worker::backend::profile::{Efficiency, Hardware, ModelCost, Profile};
use kvgate_worker::backend::sim::SimBackend;
use kvgate_worker::sched::{SchedulerConfig, SchedulingPolicy};
use kvgate_worker::{Engine, EngineConfig, NewRequest, SamplingParams};

const BLOCKS: usize = 24;
const BLOCK: usize = 4;
const CONTEXT: usize = BLOCKS * BLOCK;

#[derive(Debug, Arbitrary)]
struct Setup {
    batched_tokens: u8,
    max_seqs: u8,
    priority: bool,
    prefix_caching: bool,
    ops: Vec<Op>,
}

#[derive(Debug, Arbitrary)]
enum Op {
    /// A prompt from one of a few shared prefixes, then its own tokens.
    Add {
        prefix: u8,
        len: u8,
        max_tokens: u8,
        priority: i8,
    },
    Step,
    Abort(u8),
    ResetPrefixCache,
}

fn profile() -> Profile {
    Profile {
        name: "fuzz".into(),
        hardware: Hardware {
            name: "h".into(),
            memory_bandwidth_gb_s: 1000.0,
            peak_tflops: 100.0,
            memory_gib: 1.0,
            host_link_gb_s: None,
        },
        model: ModelCost {
            name: "m".into(),
            parameters: 1e8,
            weight_bytes: 2e8,
            layers: 2,
            hidden_size: 64,
            kv_bytes_per_token: 64.0,
        },
        efficiency: Efficiency {
            bandwidth: 1.0,
            compute: 1.0,
        },
        step_overhead_us: 0.0,
        memory_utilization: 1.0,
    }
}

pub fn kv_blocks(data: &[u8]) {
    let mut u = Unstructured::new(data);
    let Ok(setup) = Setup::arbitrary(&mut u) else {
        return;
    };
    let config = EngineConfig {
        block_size: BLOCK,
        num_blocks: Some(BLOCKS),
        max_model_len: CONTEXT,
        prefix_caching: setup.prefix_caching,
        scheduler: SchedulerConfig {
            max_num_batched_tokens: usize::from(setup.batched_tokens).max(1),
            max_num_seqs: usize::from(setup.max_seqs).max(1),
            long_prefill_token_threshold: 0,
            policy: if setup.priority {
                SchedulingPolicy::Priority
            } else {
                SchedulingPolicy::Fcfs
            },
        },
        hash_seed: HashSeed::new("fuzz", None, ""),
        eos_token_ids: vec![],
    };
    let mut engine = Engine::new(config, SimBackend::new(profile(), 17, 1000)).unwrap();
    let mut live: Vec<u64> = Vec::new();
    let mut next = 0u64;
    for op in setup.ops {
        match op {
            Op::Add {
                prefix,
                len,
                max_tokens,
                priority,
            } => {
                let len = usize::from(len) % (CONTEXT - 1) + 1;
                let prompt: Vec<u32> = (0..len as u32)
                    .map(|i| {
                        if i < 8 {
                            u32::from(prefix % 3) * 100 + i
                        } else {
                            500 + i
                        }
                    })
                    .collect();
                let max_tokens = u32::from(max_tokens).clamp(1, (CONTEXT - len) as u32);
                let request = NewRequest {
                    id: next,
                    prompt,
                    params: SamplingParams {
                        max_tokens,
                        ignore_eos: true,
                        ..Default::default()
                    },
                    priority: i32::from(priority),
                };
                engine.add_request(request).unwrap();
                live.push(next);
                next += 1;
            }
            Op::Step => {
                for t in engine.step().unwrap().tokens {
                    if t.finished.is_some() {
                        live.retain(|&id| id != t.id);
                    }
                }
            }
            Op::Abort(i) => {
                if !live.is_empty() {
                    let id = live.remove(usize::from(i) % live.len());
                    assert!(engine.abort(id));
                }
            }
            Op::ResetPrefixCache => engine.reset_prefix_cache(),
        }
        engine.check_kv().unwrap();
    }
    // Whatever came before, the engine drains: no request waits for ever.
    for _ in 0..100_000 {
        if !engine.has_work() {
            break;
        }
        for t in engine.step().unwrap().tokens {
            if t.finished.is_some() {
                live.retain(|&id| id != t.id);
            }
        }
        engine.check_kv().unwrap();
    }
    assert!(
        !engine.has_work(),
        "the engine never drained: {:?}",
        engine.stats()
    );
    assert!(live.is_empty(), "unfinished: {live:?}");
    let stats = engine.stats();
    assert_eq!(stats.kv_blocks_free, stats.kv_blocks_total, "blocks leaked");
}
