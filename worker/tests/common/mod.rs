//! Shared by the worker's integration tests.
#![allow(dead_code, clippy::panic)]

use kvgate_protocol::HashSeed;
use kvgate_worker::backend::cpu::{CpuBackend, CpuConfig};
use kvgate_worker::backend::profile::{Efficiency, Hardware, ModelCost, Profile};
use kvgate_worker::model::ModelFile;
use kvgate_worker::sched::SchedulerConfig;
use kvgate_worker::spec::{Draft, DraftAsk, Drafter};
use kvgate_worker::{Engine, EngineConfig, SamplingParams};
use std::path::PathBuf;

/// The worker crate's directory: where it was built, or `KVGATE_WORKER_DIR` for a test
/// binary run elsewhere (`scripts/gpu-check` on a machine without the build tree).
pub fn worker_dir() -> PathBuf {
    std::env::var_os("KVGATE_WORKER_DIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
}

/// The default model, fetched by `scripts/fetch-model` (the test command runs it).
pub fn default_model() -> PathBuf {
    let path = worker_dir().join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        path.exists(),
        "{} is missing: run scripts/fetch-model",
        path.display()
    );
    path
}

/// A memory-bound GPU for the sim backend: a step of up to about 100 tokens costs about as
/// much as one.
pub fn sim_profile() -> Profile {
    Profile {
        name: "test".into(),
        hardware: Hardware {
            name: "t".into(),
            memory_bandwidth_gb_s: 1000.0,
            peak_tflops: 100.0,
            memory_gib: 1.0,
            host_link_gb_s: None,
        },
        model: ModelCost {
            name: "m".into(),
            parameters: 1e8,
            weight_bytes: 2e8,
            layers: 4,
            hidden_size: 256,
            kv_bytes_per_token: 1024.0,
        },
        efficiency: Efficiency {
            bandwidth: 1.0,
            compute: 1.0,
        },
        step_overhead_us: 0.0,
        memory_utilization: 1.0,
    }
}

/// The golden prompts and llama.cpp's first-step logits for them (`tests/golden`).
pub struct Golden {
    pub cases: Vec<serde_json::Value>,
    pub logits: Vec<f32>,
}

pub fn golden() -> Golden {
    let dir = worker_dir().join("tests/golden");
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let bytes = std::fs::read(dir.join("logits.f16")).unwrap();
    let logits = bytes
        .chunks_exact(2)
        .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
        .collect();
    Golden {
        cases: reference["cases"].as_array().unwrap().clone(),
        logits,
    }
}

/// Room for one request of the context length (2,048 tokens of 45 KiB).
const KV_CACHE_BYTES: usize = 96 << 20;

pub fn backend(model: &ModelFile, threads: usize) -> CpuBackend {
    backend_with_cache(model, threads, KV_CACHE_BYTES)
}

pub fn backend_with_cache(model: &ModelFile, threads: usize, kv_cache_bytes: usize) -> CpuBackend {
    CpuBackend::load(
        &default_model(),
        model,
        &CpuConfig {
            threads,
            kv_cache_bytes,
            block_size: 16,
        },
    )
    .unwrap()
}

/// The body every backend's golden test runs: the 20 golden prompts' first-step logits, from
/// `logits` (one prompt slice in, its logits row out), against llama.cpp's, which are stored
/// as f16 — so "equal" means: ours, rounded to f16 the same way, give the same bits (an f32
/// difference of one unit in the last place can break that only when it straddles an f16
/// rounding boundary, and then this reports it). Panics on any difference.
pub fn check_first_step_logits(
    model: &ModelFile,
    mut logits: impl FnMut(&[kvgate_worker::backend::BatchSlice<'_>]) -> Vec<f32>,
) {
    let g = golden();
    let vocab = model.params.vocab_size;
    let params = SamplingParams::default();
    let mut differing_prompts = Vec::new();
    for (n, case) in g.cases.iter().enumerate() {
        let prompt = ids(case);
        let table: Vec<u32> = (1..=prompt.len().div_ceil(16) as u32).collect();
        let slice = kvgate_worker::backend::BatchSlice {
            id: 0,
            tokens: &prompt,
            start: 0,
            len: prompt.len(),
            block_table: &table,
            samples: true,
            draft: 0,
            params: &params,
            num_output_tokens: 0,
        };
        let ours = logits(&[slice]);
        let reference = &g.logits[n * vocab..(n + 1) * vocab];
        let differing = ours
            .iter()
            .zip(reference)
            .filter(|(a, b)| half::f16::from_f32(**a).to_f32() != **b)
            .count();
        let max = ours
            .iter()
            .zip(reference)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        let top1 = kvgate_worker::sample::argmax(&ours);
        let same_top1 = u64::from(top1) == case["top1"].as_u64().unwrap_or(u64::MAX);
        if differing > 0 || !same_top1 {
            eprintln!(
                "case {n} ({} tokens): {differing} of {vocab} logits differ from llama.cpp's (max |diff| {max}), top-1 {}",
                prompt.len(),
                if same_top1 { "the same" } else { "DIFFERS" }
            );
            differing_prompts.push(n);
        }
    }
    assert!(
        differing_prompts.is_empty(),
        "first-step logits differ from llama.cpp's on prompts {differing_prompts:?}"
    );
}

/// The other half of the golden test: all 20 prompts at once through `engine` (batching and
/// chunked prefill included), 32 greedy tokens each; how many continuations equal
/// llama.cpp's (each divergence printed).
pub fn greedy_agreement<B: kvgate_worker::backend::Backend>(engine: &mut Engine<B>) -> usize {
    let g = golden();
    for (n, case) in g.cases.iter().enumerate() {
        engine
            .add_request(kvgate_worker::NewRequest {
                id: n as u64,
                prompt: ids(case),
                params: greedy(32),
                priority: 0,
            })
            .unwrap();
    }
    let out = run(engine);
    let mut agree = 0;
    for (n, case) in g.cases.iter().enumerate() {
        let expected: Vec<u32> = serde_json::from_value(case["greedy"].clone()).unwrap();
        let ours = out.get(&(n as u64)).cloned().unwrap_or_default();
        if ours == expected {
            agree += 1;
        } else {
            let same = ours
                .iter()
                .zip(&expected)
                .take_while(|(a, b)| a == b)
                .count();
            eprintln!("case {n}: diverges after {same} tokens: {ours:?} vs {expected:?}");
        }
    }
    eprintln!("greedy 32-token continuations equal llama.cpp's on {agree} of 20 prompts");
    agree
}

pub fn ids(case: &serde_json::Value) -> Vec<u32> {
    serde_json::from_value(case["ids"].clone()).unwrap()
}

pub fn engine(model: &ModelFile, threads: usize) -> Engine<CpuBackend> {
    engine_with_cache(model, threads, KV_CACHE_BYTES)
}

pub fn engine_with_cache(
    model: &ModelFile,
    threads: usize,
    kv_cache_bytes: usize,
) -> Engine<CpuBackend> {
    Engine::new(
        engine_config(model),
        backend_with_cache(model, threads, kv_cache_bytes),
    )
    .unwrap()
}

/// The engine the golden tests run: blocks of 16, chunks of 512 tokens, 32 sequences.
pub fn engine_config(model: &ModelFile) -> EngineConfig {
    EngineConfig {
        block_size: 16,
        num_blocks: None,
        max_model_len: 2048,
        prefix_caching: true,
        scheduler: SchedulerConfig {
            max_num_batched_tokens: 512,
            max_num_seqs: 32,
            ..Default::default()
        },
        hash_seed: HashSeed::new("test", None, ""),
        eos_token_ids: model.prompt.tokenizer.eos_token_id.into_iter().collect(),
    }
}

pub fn greedy(max_tokens: u32) -> SamplingParams {
    SamplingParams {
        max_tokens,
        temperature: 0.0,
        ..Default::default()
    }
}

pub fn run<B: kvgate_worker::backend::Backend>(
    e: &mut Engine<B>,
) -> std::collections::HashMap<u64, Vec<u32>> {
    let mut out: std::collections::HashMap<u64, Vec<u32>> = Default::default();
    while e.has_work() {
        for t in e.step().unwrap().tokens {
            // llama.cpp's continuation stops before the end-of-sequence token.
            if t.finished != Some(kvgate_worker::FinishReason::Stop) {
                out.entry(t.id).or_default().push(t.token);
            }
        }
    }
    out
}

/// A path in the temporary directory for a file named `…-name`, removed when dropped.
pub fn temp_file(name: &str) -> tempfile::TempPath {
    tempfile::Builder::new()
        .prefix("kvgate-")
        .suffix(&format!("-{name}"))
        .tempfile()
        .unwrap()
        .into_temp_path()
}

/// A drafter whose drafts are taken as free, so that every one is verified (the engine would
/// not verify a draft model's drafts where they cost as much as they can save).
pub struct Free(pub Box<dyn Drafter>);

impl Drafter for Free {
    fn propose(&mut self, context: &[u32], k: usize) -> Vec<u32> {
        self.0.propose(context, k)
    }

    fn propose_batch(&mut self, asks: &[DraftAsk<'_>]) -> Vec<Draft> {
        self.0.propose_batch(asks)
    }

    fn forget(&mut self, id: u64) {
        self.0.forget(id);
    }

    fn clone_box(&self) -> Box<dyn Drafter> {
        Box::new(Free(self.0.clone_box()))
    }
}
