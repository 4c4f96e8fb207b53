//! The draft-model drafter on the real model: the target drafting for itself is almost always
//! right, a copy cut to its first layers far less often, and output is the same either way;
//! its own KV cache gives every block back; a draft model it cannot use is refused with why.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{temp_file, Free};
use kvgate_worker::backend::cpu::kv_cache::KvCache;
use kvgate_worker::backend::Backend;
use kvgate_worker::model::gguf::Value;
use kvgate_worker::model::{cut_layers, rewrite, ModelFile};
use kvgate_worker::spec::{DraftAsk, Drafter, Method, NgramSettings, SpecConfig, StepCosts};
use kvgate_worker::NewRequest;

const DRAFT_KV: usize = 64 << 20;

fn model() -> ModelFile {
    ModelFile::open(&common::default_model()).unwrap()
}

fn draft_method(path: &std::path::Path, kv_cache_bytes: usize) -> Method {
    Method::Draft {
        model: path.to_path_buf(),
        kv_cache_bytes,
    }
}

fn draft_config(path: &std::path::Path) -> SpecConfig {
    let method = draft_method(path, DRAFT_KV);
    SpecConfig::new(method, 4, NgramSettings::new(2, 4).unwrap(), None).unwrap()
}

/// Greedy output of every prompt, `together` at a time, and the share of drafted tokens kept.
fn run(
    e: &mut kvgate_worker::Engine<kvgate_worker::backend::cpu::CpuBackend>,
    prompts: &[Vec<u32>],
    together: usize,
) -> (Vec<Vec<u32>>, f64) {
    let before = e.stats().spec;
    let mut out = vec![Vec::new(); prompts.len()];
    for (group, chunk) in prompts.chunks(together).enumerate() {
        for (j, prompt) in chunk.iter().enumerate() {
            e.add_request(NewRequest {
                id: (group * together + j) as u64,
                prompt: prompt.clone(),
                params: common::greedy(12),
                priority: 0,
            })
            .unwrap();
        }
        while e.has_work() {
            for t in e.step().unwrap().tokens {
                out[t.id as usize].push(t.token);
            }
        }
        e.check_kv().unwrap();
    }
    let after = e.stats().spec;
    let drafted = (after.draft_tokens - before.draft_tokens) as f64;
    let kept = (after.accepted_tokens - before.accepted_tokens) as f64;
    (out, kept / drafted.max(1.0))
}

#[test]
fn the_target_drafting_for_itself_is_almost_always_right_and_a_cut_copy_less() {
    let model = model();
    let prompts: Vec<Vec<u32>> = common::golden().cases.iter().map(common::ids).collect();
    let cut = temp_file("cut-2.gguf");
    cut_layers(&common::default_model(), &cut, 2).unwrap();
    let flat = StepCosts::from_points(vec![(1, 1.0), (512, 1.0)]).unwrap();
    let mut e = common::engine(&model, 2);
    let (plain, _) = run(&mut e, &prompts, 1);
    let mut rates = Vec::new();
    for draft in [common::default_model(), cut.to_path_buf()] {
        let config = draft_config(&draft);
        let drafter = e.backend_mut().drafter(&config.method).unwrap();
        e.enable_speculation_at(config, Box::new(Free(drafter)), flat.clone());
        for together in [1, 5] {
            let (fast, rate) = run(&mut e, &prompts, together);
            for (i, (p, f)) in plain.iter().zip(&fast).enumerate() {
                assert_eq!(
                    p,
                    f,
                    "{}, {together} at a time: prompt {i}",
                    draft.display()
                );
            }
            eprintln!(
                "{}: {together} at a time, {rate:.3} of drafted tokens kept",
                draft.display()
            );
            rates.push(rate);
        }
    }
    assert!(rates[..2].iter().all(|&r| r > 0.9), "{rates:?}");
    assert!(rates[2..].iter().all(|&r| r < 0.5), "{rates:?}");
}

#[test]
fn the_draft_cache_gives_every_block_back_and_makes_room_for_new_requests() {
    let model = model();
    let backend = common::backend(&model, 2);
    let cut = temp_file("cut-1.gguf");
    cut_layers(&common::default_model(), &cut, 1).unwrap();
    // Room for about three 100-token requests at a time.
    // One layer, 3 KV heads of 64.
    let bytes_per_block = KvCache::bytes_per_token(1, 192) * 16;
    let mut d = backend.draft_model(&cut, 20 * bytes_per_block).unwrap();
    assert_eq!(d.total_blocks(), 20);
    let contexts: Vec<Vec<u32>> = (0..8u32)
        .map(|r| (0..100).map(|i| 200 + (i * 31 + r * 7) % 5000).collect())
        .collect();
    for round in 0..30usize {
        let asks: Vec<DraftAsk<'_>> = (0..3)
            .map(|j| {
                let r = (round + j) % contexts.len();
                let len = 50 + (round * 7 + j * 13) % 50;
                DraftAsk {
                    id: r as u64,
                    context: &contexts[r][..len],
                    num_prompt_tokens: 40,
                    k: 1 + (round + j) % 6,
                }
            })
            .collect();
        let drafts = d.propose_batch(&asks);
        for (ask, draft) in asks.iter().zip(&drafts) {
            assert_eq!(draft.tokens.len(), ask.k, "round {round}: every ask fits");
            assert_eq!(d.cached_tokens(ask.id), ask.context.len() + ask.k - 1);
        }
        if round % 4 == 0 {
            d.forget(asks[0].id);
        }
    }
    // Too long for the whole cache: no draft, and nothing kept for it.
    let huge: Vec<u32> = (0..400).map(|i| 300 + i).collect();
    let ask = DraftAsk {
        id: 99,
        context: &huge,
        num_prompt_tokens: 400,
        k: 4,
    };
    assert!(d.propose_batch(&[ask])[0].tokens.is_empty());
    assert_eq!(d.cached_tokens(99), 0);
    for id in 0..contexts.len() as u64 {
        d.forget(id);
    }
    assert_eq!(d.free_blocks(), d.total_blocks());
    // Catching up from a kept state drafts as drafting from nothing does.
    let ask = |len: usize, k: usize| DraftAsk {
        id: 1,
        context: &contexts[0][..len],
        num_prompt_tokens: 60,
        k,
    };
    d.propose_batch(&[ask(50, 5)]);
    let caught_up = d.propose_batch(&[ask(60, 3)]);
    assert_eq!(d.propose(&contexts[0][..60], 3), caught_up[0].tokens);
}

#[test]
fn a_draft_model_the_target_cannot_use_is_refused_with_why() {
    let model = model();
    let mut backend = common::backend(&model, 1);
    let src = common::default_model();
    let refused = |b: &mut kvgate_worker::backend::cpu::CpuBackend, path: &std::path::Path| {
        b.drafter(&draft_method(path, DRAFT_KV))
            .err()
            .expect("refused")
    };

    let e = refused(
        &mut backend,
        std::path::Path::new("/nonexistent/draft.gguf"),
    );
    assert!(
        e.contains("/nonexistent/draft.gguf") && e.contains("cannot read"),
        "{e}"
    );

    let junk = temp_file("junk.gguf");
    std::fs::write(&junk, b"this is not a model").unwrap();
    let e = refused(&mut backend, &junk);
    assert!(
        e.contains("draft model") && e.contains("not a GGUF file"),
        "{e}"
    );

    let smaller = temp_file("vocab.gguf");
    rewrite(&src, &smaller, |g| {
        g.metadata
            .insert("llama.vocab_size".into(), Value::U32(32_000));
        Ok(())
    })
    .unwrap();
    let e = refused(&mut backend, &smaller);
    assert!(
        e.contains("32000 tokens") && e.contains("the target's 49152"),
        "{e}"
    );

    let renamed = temp_file("tokens.gguf");
    rewrite(&src, &renamed, |g| {
        let Some(Value::Array(tokens)) = g.metadata.get_mut("tokenizer.ggml.tokens") else {
            return Err("no tokens".into());
        };
        // Swapped, so that the tokenizer still finds every token its merges name.
        tokens.swap(1000, 1001);
        Ok(())
    })
    .unwrap();
    let e = refused(&mut backend, &renamed);
    assert!(e.contains("differs") && e.contains("token 1000"), "{e}");

    let e = backend
        .drafter(&draft_method(&src, 1))
        .err()
        .expect("refused");
    assert!(e.contains("below one block"), "{e}");

    let e = backend
        .drafter(&Method::Modelled { acceptance: 0.5 })
        .err()
        .expect("refused");
    assert!(e.contains("need the sim backend"), "{e}");
}
