//! The CUDA backend on a GPU against llama.cpp, with the test bodies `cpu_backend.rs` runs on
//! the CPU backend (`common::check_first_step_logits`, `common::greedy_agreement`): the same
//! first-step logits on the 20 golden prompts, the same greedy continuations; plus drafts
//! verified, sampling and K/V export on the device. The kernels compute the CPU backend's arithmetic operation by
//! operation (`cuda_emulated.rs` checks them bit for bit on the CPU), so the bar is the CPU
//! backend's own. Needs an NVIDIA GPU: without one every test says so loudly and passes only
//! where `KVGATE_REQUIRE_GPU` is unset (`scripts/gpu-check` sets it).
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvgate_worker::backend::cuda::{CudaBackend, CudaConfig};
use kvgate_worker::backend::{Backend, BatchSlice};
use kvgate_worker::model::ModelFile;
use kvgate_worker::{Engine, SamplingParams};

mod common;

use common::{
    check_first_step_logits, default_model, engine_config, golden, greedy, greedy_agreement, ids,
};

/// Golden prompts whose 32-token greedy continuation must equal llama.cpp's: the CPU
/// backend's bar (measured there: 20); the issue asks for 15.
const GREEDY_AGREEMENT: usize = 18;

fn cuda(model: &ModelFile) -> Option<CudaBackend> {
    let config = CudaConfig {
        gpu: 0,
        memory_utilization: 0.3,
        block_size: 16,
    };
    match CudaBackend::load(&default_model(), model, &config) {
        Ok(b) => {
            eprintln!("cuda backend on {}", b.describe());
            Some(b)
        }
        Err(e) => {
            let message = format!("no CUDA backend here, the cross-backend tests did NOT run: {e}");
            assert!(
                std::env::var_os("KVGATE_REQUIRE_GPU").is_none(),
                "{message}"
            );
            eprintln!("SKIPPED: {message}");
            None
        }
    }
}

fn prompt_slice<'a>(
    tokens: &'a [u32],
    table: &'a [u32],
    params: &'a SamplingParams,
) -> BatchSlice<'a> {
    BatchSlice {
        id: 0,
        tokens,
        start: 0,
        len: tokens.len(),
        block_table: table,
        samples: true,
        draft: 0,
        params,
        num_output_tokens: 0,
    }
}

fn table_for(len: usize) -> Vec<u32> {
    (1..=len.div_ceil(16) as u32).collect()
}

#[test]
fn first_step_logits_equal_llama_cpp() {
    let model = ModelFile::open(&default_model()).unwrap();
    let Some(mut gpu) = cuda(&model) else { return };
    check_first_step_logits(&model, |batch| gpu.logits(batch).unwrap().remove(0).1);
}

#[test]
fn greedy_continuations_equal_llama_cpp() {
    let model = ModelFile::open(&default_model()).unwrap();
    let Some(gpu) = cuda(&model) else { return };
    let agree = greedy_agreement(&mut Engine::new(engine_config(&model), gpu).unwrap());
    assert!(agree >= GREEDY_AGREEMENT, "{agree} of 20");
}

/// The model's own 8 next tokens as a draft are all kept, with the 9th; a wrong 4th token
/// keeps three and replaces the 4th (one step for several tokens, as on the CPU).
#[test]
fn a_drafted_slice_keeps_the_tokens_the_model_would_have_chosen() {
    let model = ModelFile::open(&default_model()).unwrap();
    let Some(mut gpu) = cuda(&model) else { return };
    let g = golden();
    let params = greedy(9);
    let mut checked = 0;
    for case in g.cases.iter().take(6) {
        let prompt = ids(case);
        // The continuation, one token per step.
        let mut tokens = prompt.clone();
        for _ in 0..9 {
            let table = table_for(tokens.len());
            let out = gpu
                .execute(&[prompt_slice(&tokens, &table, &params)])
                .unwrap();
            tokens.push(out.sampled[0].token);
        }
        let continuation = tokens[prompt.len()..].to_vec();
        let verify = |gpu: &mut CudaBackend, draft: &[u32]| -> Vec<u32> {
            let all: Vec<u32> = prompt.iter().chain(draft).copied().collect();
            let table = table_for(all.len());
            let slice = BatchSlice {
                draft: draft.len(),
                ..prompt_slice(&all, &table, &params)
            };
            gpu.execute(&[slice])
                .unwrap()
                .sampled
                .iter()
                .map(|s| s.token)
                .collect()
        };
        assert_eq!(verify(&mut gpu, &continuation[..8]), continuation);
        let mut wrong = continuation[..8].to_vec();
        wrong[3] = (wrong[3] + 1) % model.params.vocab_size as u32;
        assert_eq!(verify(&mut gpu, &wrong), continuation[..4]);
        checked += 1;
    }
    assert_eq!(checked, 6);
}

#[test]
fn sampling_with_logprobs_and_a_seed_is_repeatable() {
    let model = ModelFile::open(&default_model()).unwrap();
    let Some(mut gpu) = cuda(&model) else { return };
    let prompt = ids(&golden().cases[0]);
    let table = table_for(prompt.len());
    let params = SamplingParams {
        temperature: 0.8,
        top_p: 0.9,
        seed: Some(7),
        logprobs: Some(3),
        ..greedy(1)
    };
    let first = gpu
        .execute(&[prompt_slice(&prompt, &table, &params)])
        .unwrap();
    let again = gpu
        .execute(&[prompt_slice(&prompt, &table, &params)])
        .unwrap();
    assert_eq!(first.sampled, again.sampled);
    let s = &first.sampled[0];
    assert!((s.token as usize) < model.params.vocab_size);
    assert!(s.logprobs.is_some());
}

#[test]
fn a_block_exported_and_imported_elsewhere_gives_the_same_logits() {
    let model = ModelFile::open(&default_model()).unwrap();
    let Some(mut gpu) = cuda(&model) else { return };
    let params = SamplingParams::default();
    let prompt: Vec<u32> = ids(&golden().cases[1])
        .into_iter()
        .cycle()
        .take(17)
        .collect();
    // The first 16 tokens' K/V in block 1, then moved to block 7.
    let first = gpu
        .logits(&[prompt_slice(&prompt, &[1, 2], &params)])
        .unwrap();
    let data = gpu.export_block(1).unwrap();
    gpu.import_block(7, &data).unwrap();
    assert_eq!(gpu.export_block(7).unwrap(), data);
    // The last token alone, reading the first 16 from block 7.
    let last = BatchSlice {
        start: 16,
        len: 1,
        block_table: &[7, 2],
        ..prompt_slice(&prompt, &[], &params)
    };
    let second = gpu.logits(&[last]).unwrap();
    let diff = first[0]
        .1
        .iter()
        .zip(&second[0].1)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    // The same K/V; only the one-token step's product shape differs.
    assert!(diff < 0.05, "max |diff| {diff}");
    assert!(gpu.import_block(7, &data[1..]).is_err());
    assert!(gpu.export_block(0).is_none());
}
