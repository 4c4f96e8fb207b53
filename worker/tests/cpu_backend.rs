//! The CPU backend against llama.cpp on the same GGUF (golden data recorded from
//! llama-cpp-python 0.3.36 over llama.cpp built for AVX2, by `tests/golden/record_logits.py`;
//! `bench/peers/install-llama` builds that oracle): the same prompt ids and rendering, the same
//! first-step logits bit for bit, the same 32-token greedy continuations; and a request's
//! greedy output is the same alone or in a batch.
//!
//! Why bit for bit: this model amplifies last-bit differences (its residual stream reaches
//! 2.5e4, and 8-bit activation codes flip), so even two llama.cpp builds disagree — its native
//! AMX build and its AVX2 build give the same 32 greedy tokens on only 6 of these 20 prompts.
//! The backend therefore reproduces the AVX2 build's arithmetic operation by operation
//! (`attention.rs`, `ggml_math.rs`, `dot/`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvgate_worker::backend::cpu::CpuBackend;
use kvgate_worker::backend::BatchSlice;
use kvgate_worker::model::template::TemplateMessage;
use kvgate_worker::model::ModelFile;
use kvgate_worker::{NewRequest, SamplingParams};

mod common;

use common::{
    backend, check_first_step_logits, default_model, engine, golden, greedy, greedy_agreement, ids,
    run,
};

/// Prompts (of 20) whose 32-token greedy continuation must equal llama.cpp's (the issue's
/// bar; measured: 20).
const GREEDY_AGREEMENT: usize = 18;

#[test]
fn prompts_tokenize_and_render_as_llama_cpp_does() {
    let model = ModelFile::open(&default_model()).unwrap();
    for case in golden().cases {
        let text = case["text"].as_str().unwrap();
        let rendered = if case["kind"] == "chat" {
            let messages = [TemplateMessage {
                role: "user".into(),
                content: text.into(),
            }];
            model
                .prompt
                .template
                .as_ref()
                .unwrap()
                .render(&messages)
                .unwrap()
        } else {
            text.to_string()
        };
        assert_eq!(rendered, case["rendered"].as_str().unwrap());
        assert_eq!(
            model.prompt.tokenizer.encode(&rendered, true).unwrap(),
            ids(&case),
            "{text:?}"
        );
    }
}

#[test]
fn first_step_logits_equal_llama_cpp() {
    let model = ModelFile::open(&default_model()).unwrap();
    let mut cpu = backend(&model, 1);
    check_first_step_logits(&model, |batch| cpu.logits(batch).remove(0).1);
}

#[test]
fn greedy_continuations_equal_llama_cpp() {
    let model = ModelFile::open(&default_model()).unwrap();
    // All 20 at once, on two threads: batching, chunked prefill and threading must not change
    // any request's tokens.
    let agree = greedy_agreement(&mut engine(&model, 2));
    assert!(
        agree >= GREEDY_AGREEMENT,
        "greedy continuations equal llama.cpp's on {agree} of 20 prompts"
    );
}

#[test]
fn a_prompt_gives_the_same_greedy_output_alone_or_among_16_others() {
    let model = ModelFile::open(&default_model()).unwrap();
    let g = golden();
    let mut batch = engine(&model, 1);
    for (n, case) in g.cases.iter().take(17).enumerate() {
        batch
            .add_request(NewRequest {
                id: n as u64,
                prompt: ids(case),
                params: greedy(32),
                priority: 0,
            })
            .unwrap();
    }
    let batched = run(&mut batch);
    let mut alone = engine(&model, 1);
    alone
        .add_request(NewRequest {
            id: 3,
            prompt: ids(&g.cases[3]),
            params: greedy(32),
            priority: 0,
        })
        .unwrap();
    let single = run(&mut alone);
    assert!(single.get(&3).is_some_and(|t| !t.is_empty()));
    assert_eq!(single.get(&3), batched.get(&3));
}

/// A slice whose last tokens are a draft gets the model's own token at each drafted position:
/// the draft's kept tokens, then the model's next (one step for several tokens).
#[test]
fn a_drafted_slice_keeps_the_tokens_the_model_would_have_chosen() {
    let model = ModelFile::open(&default_model()).unwrap();
    let g = golden();
    let mut e = engine(&model, 1);
    let cases: Vec<Vec<u32>> = g.cases.iter().take(6).map(ids).collect();
    for (n, prompt) in cases.iter().enumerate() {
        e.add_request(NewRequest {
            id: n as u64,
            prompt: prompt.clone(),
            params: greedy(9),
            priority: 0,
        })
        .unwrap();
    }
    let reference = run(&mut e);
    let mut cpu = backend(&model, 1);
    let params = greedy(9);
    let mut checked = 0;
    for (n, prompt) in cases.iter().enumerate() {
        let continuation = &reference[&(n as u64)];
        if continuation.len() < 9 {
            continue; // it ended early: nothing to draft past the end
        }
        let verify = |cpu: &mut CpuBackend, draft: &[u32]| -> Vec<u32> {
            execute_drafted(cpu, prompt, draft, &params)
        };
        // The model's own 8 tokens as the draft: all kept, and the 9th comes with them.
        assert_eq!(
            verify(&mut cpu, &continuation[..8]),
            continuation[..9],
            "case {n}"
        );
        // A wrong 4th token: the first three kept, then the model's own 4th.
        let mut wrong = continuation[..8].to_vec();
        wrong[3] = (wrong[3] + 1) % model.params.vocab_size as u32;
        assert_eq!(verify(&mut cpu, &wrong), continuation[..4], "case {n}");
        checked += 1;
    }
    assert!(checked >= 3, "only {checked} prompts ran 9 tokens");
    // Sampled, with top-p keeping only the model's best token: a draft that starts with another
    // token is rejected at once, and the model's own token follows.
    let prompt = &cases[0];
    let continuation = &reference[&0];
    let narrow = SamplingParams {
        temperature: 1.0,
        top_p: 1e-6,
        ..greedy(9)
    };
    let mut wrong = continuation[..4].to_vec();
    wrong[0] = (wrong[0] + 1) % model.params.vocab_size as u32;
    assert_eq!(
        execute_drafted(&mut cpu, prompt, &wrong, &narrow),
        continuation[..1],
        "only the model's own first token"
    );
}

/// One step of a fresh request: `prompt` then `draft`, the draft verified; the tokens it emits.
fn execute_drafted(
    cpu: &mut CpuBackend,
    prompt: &[u32],
    draft: &[u32],
    params: &SamplingParams,
) -> Vec<u32> {
    use kvgate_worker::backend::Backend;
    let tokens: Vec<u32> = prompt.iter().chain(draft).copied().collect();
    let table: Vec<u32> = (1..=tokens.len().div_ceil(16) as u32).collect();
    let slice = BatchSlice {
        id: 0,
        tokens: &tokens,
        start: 0,
        len: tokens.len(),
        block_table: &table,
        samples: true,
        draft: draft.len(),
        params,
        num_output_tokens: 0,
    };
    let out = cpu.execute(&[slice]).unwrap();
    out.sampled.iter().map(|s| s.token).collect()
}
