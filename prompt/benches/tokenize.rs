//! Gateway-side prompt cost: render a 4k-token chat prompt, tokenize it and hash its blocks.
//! `cold`: no segment cached (the tokenizer on the whole text, its word cache holding the words
//! of earlier iterations, as a running gateway's does; `cold_crate_pipeline` through the
//! `tokenizers` crate's whole pipeline instead of the direct pre-tokenizer); `cached system
//! prompt`: the system prompt was seen before (the 512 questions cycle, so after the first pass
//! they come from the segment cache too). `user_turn`: a question alone, both ways.
//! `chat_prompt_200B`: the proxy bench's small request, its render and its tokenization apart.
//! Run: `cargo bench -p kvgate-prompt --bench tokenize` (needs `scripts/fetch-model`).

#![allow(clippy::panic)]

use criterion::{criterion_group, criterion_main, Criterion};
use kvgate_prompt::template::{ChatTemplate, TemplateMessage};
use kvgate_prompt::PromptModel;
use kvgate_protocol::openai::{Endpoint, GenerationRequest};
use kvgate_protocol::{block_hashes, HashSeed};
use std::hint::black_box;
use std::path::PathBuf;

const BLOCK: usize = 16;
/// Long enough for every prompt here.
const CONTEXT: usize = 1 << 20;

fn system_prompt() -> String {
    let facts = [
        "The support desk answers questions about invoices, refunds and delivery times.",
        "Orders placed before noon ship the same day; later orders ship the next working day.",
        "Refunds are issued to the original payment method within 5 to 7 business days.",
        "Never reveal internal ticket numbers, and always greet the customer by name.",
        "When a parcel is late by more than 3 days, offer a voucher worth 10 percent.",
    ];
    let mut s = String::from("You are Ada, the assistant of an online bookshop. Rules:\n");
    for i in 0..165 {
        s.push_str(&format!("Rule {i}: {}\n", facts[i % facts.len()]));
    }
    s
}

fn requests(system: &str, n: usize) -> Vec<GenerationRequest> {
    (0..n)
        .map(|i| {
            let question = format!("Hello, I am customer {i}. My order {} from last week has not arrived yet and the tracking page shows no movement since Monday. Could you tell me what happened, when it will arrive, and whether I can get a refund for the shipping cost if it is late again? Thanks a lot for your help with this.", 1000 + i);
            let body = serde_json::json!({
                "model": "m",
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": question},
                ],
            });
            GenerationRequest::parse(Endpoint::Chat, body.to_string().as_bytes())
                .unwrap_or_else(|e| panic!("{}", e.message))
        })
        .collect()
}

/// The request's chat prompt as the template renders it.
fn chat_text(template: &ChatTemplate, request: &GenerationRequest) -> String {
    let messages: Vec<_> = request
        .messages
        .iter()
        .flatten()
        .map(|m| TemplateMessage {
            role: m.role.clone(),
            content: m
                .content
                .as_ref()
                .map(|c| c.text().into_owned())
                .unwrap_or_default(),
        })
        .collect();
    template.render(&messages).unwrap_or_default()
}

fn bench(c: &mut Criterion) {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let model = PromptModel::open(&path).unwrap_or_else(|e| panic!("{e}"));
    let seed = HashSeed::new("m", None, "");
    let system = system_prompt();
    let reqs = requests(&system, 512);
    let (ids, _) = model
        .prompt_ids(Endpoint::Chat, &reqs[0], CONTEXT)
        .unwrap_or_else(|e| panic!("{}", e.message));
    println!(
        "prompt: {} tokens, {} blocks of {BLOCK}",
        ids.len(),
        ids.len() / BLOCK
    );
    let template = model
        .template
        .as_ref()
        .unwrap_or_else(|| panic!("no template"));
    let render = |i: usize| chat_text(template, &reqs[i]);
    let mut group = c.benchmark_group("chat_prompt_4k");
    let mut i = 0;
    group.bench_function("cold", |b| {
        b.iter(|| {
            i = (i + 1) % reqs.len();
            let ids = model.tokenizer.encode(&render(i), true).unwrap_or_default();
            black_box(block_hashes(seed, &ids, BLOCK))
        })
    });
    group.bench_function("cold_crate_pipeline", |b| {
        b.iter(|| {
            i = (i + 1) % reqs.len();
            let text = render(i);
            let ids = model.tokenizer.encode_reference(&text, true);
            black_box(block_hashes(seed, &ids.unwrap_or_default(), BLOCK))
        })
    });
    group.bench_function("cached_system_prompt", |b| {
        b.iter(|| {
            i = (i + 1) % reqs.len();
            let (ids, _) = model
                .prompt_ids(Endpoint::Chat, &reqs[i], CONTEXT)
                .unwrap_or_default();
            black_box(block_hashes(seed, &ids, BLOCK))
        })
    });
    group.finish();

    // A request's new user turn alone: what token mode pays per request once the system
    // prompt comes from the segment cache; directly pre-tokenized and through the
    // `tokenizers` crate's whole pipeline.
    let turn = |i: usize| {
        let user = reqs[i].messages.iter().flatten().nth(1);
        user.and_then(|m| m.content.as_ref())
            .map(|c| c.text().into_owned())
            .unwrap_or_default()
    };
    let mut group = c.benchmark_group("user_turn");
    for (size, text) in [
        ("20B", "Where is my order 42?".to_string()),
        ("300B", turn(7)),
    ] {
        let t = &model.tokenizer;
        group.bench_function(format!("{size}/direct"), |b| {
            b.iter(|| black_box(t.encode(black_box(&text), true)))
        });
        group.bench_function(format!("{size}/crate"), |b| {
            b.iter(|| black_box(t.encode_reference(black_box(&text), true)))
        });
    }
    group.finish();

    // The proxy bench's 200 B chat request (`bench/proxy/run.py`): a short system prompt and a
    // question numbered per request, so no segment is long enough for the segment cache.
    let small: Vec<GenerationRequest> = (0..512)
        .map(|i| {
            let body = serde_json::json!({
                "model": "m",
                "messages": [
                    {"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": format!("Question {i}: say ok.")},
                ],
            });
            GenerationRequest::parse(Endpoint::Chat, body.to_string().as_bytes())
                .unwrap_or_else(|e| panic!("{}", e.message))
        })
        .collect();
    let small_text = |i: usize| chat_text(template, &small[i]);
    let rendered: Vec<String> = (0..small.len()).map(small_text).collect();
    let mut group = c.benchmark_group("chat_prompt_200B");
    group.bench_function("render", |b| {
        b.iter(|| {
            i = (i + 1) % small.len();
            black_box(small_text(i))
        })
    });
    group.bench_function("encode_rendered", |b| {
        b.iter(|| {
            i = (i + 1) % small.len();
            black_box(model.encode(&rendered[i]))
        })
    });
    group.bench_function("prompt_ids", |b| {
        b.iter(|| {
            i = (i + 1) % small.len();
            let (ids, _) = model
                .prompt_ids(Endpoint::Chat, &small[i], CONTEXT)
                .unwrap_or_default();
            black_box(block_hashes(seed, &ids, BLOCK))
        })
    });
    group.finish();

    // An agent's long conversation of short turns: what rendering costs per message, against
    // what tokenizing costs per byte above (the gateway weighs the two to keep a request's
    // work on the proxy thread small).
    let turns: Vec<serde_json::Value> = (0..256)
        .map(|k| {
            let role = if k % 2 == 0 { "user" } else { "assistant" };
            serde_json::json!({"role": role, "content": format!("step {k}: ok")})
        })
        .collect();
    let body = serde_json::json!({"model": "m", "messages": turns});
    let long = GenerationRequest::parse(Endpoint::Chat, body.to_string().as_bytes())
        .unwrap_or_else(|e| panic!("{}", e.message));
    c.bench_function("render_256_short_messages", |b| {
        b.iter(|| black_box(chat_text(template, &long)))
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
