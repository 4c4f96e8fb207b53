//! Reading a chat request's body, as the gateway does for every request: `parse` (the body
//! read once, its path tracked only to explain a failure) against reading it with the path
//! tracked throughout (how every body was read before), for the proxy harness's body sizes.
//! Run: `cargo bench -p kvgate-protocol --bench parse`.

#![allow(clippy::unwrap_used)]

use criterion::{criterion_group, criterion_main, Criterion};
use kvgate_protocol::openai::{Endpoint, GenerationRequest};
use std::hint::black_box;

fn body(system_bytes: usize) -> Vec<u8> {
    let words = [
        "the",
        "model",
        "answers",
        "questions",
        "about",
        "servers",
        "briefly",
    ];
    let mut system = String::from("You are a helpful assistant.");
    while system.len() < system_bytes {
        system.push(' ');
        system.push_str(words[system.len() % words.len()]);
    }
    serde_json::to_vec(&serde_json::json!({
        "model": "bench",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "Question 1234: say ok."},
        ],
        "max_tokens": 8,
    }))
    .unwrap()
}

fn parse(c: &mut Criterion) {
    for (name, size) in [("200B", 0), ("8KB", 8 << 10), ("64KB", 64 << 10)] {
        let body = body(size);
        c.bench_function(&format!("parse/{name}"), |b| {
            b.iter(|| GenerationRequest::parse(Endpoint::Chat, black_box(&body)).unwrap())
        });
        c.bench_function(&format!("parse_path_tracked/{name}"), |b| {
            b.iter(|| {
                let mut de = serde_json::Deserializer::from_slice(black_box(&body));
                let r: GenerationRequest = serde_path_to_error::deserialize(&mut de).unwrap();
                r.validate(Endpoint::Chat).unwrap();
                r
            })
        });
    }
}

/// A body just under the gateway's in-place limit (128 KiB) made of 3,000 short turns: what
/// parsing costs where it is structure, not text.
fn parse_many_turns(c: &mut Criterion) {
    let turns: Vec<_> = (0..3000)
        .map(|i| {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            serde_json::json!({"role": role, "content": format!("a{i}")})
        })
        .collect();
    let body =
        serde_json::to_vec(&serde_json::json!({"model": "bench", "messages": turns})).unwrap();
    c.bench_function("parse/3000_turns", |b| {
        b.iter(|| GenerationRequest::parse(Endpoint::Chat, black_box(&body)).unwrap())
    });
    let escaped = "line\n".repeat(20_000);
    let body = serde_json::to_vec(&serde_json::json!({"model": "bench",
        "messages": [{"role": "user", "content": escaped}]}))
    .unwrap();
    c.bench_function("parse/20000_escapes", |b| {
        b.iter(|| GenerationRequest::parse(Endpoint::Chat, black_box(&body)).unwrap())
    });
    let ids: Vec<u32> = (0..20_000).collect();
    let body = serde_json::to_vec(&serde_json::json!({"model": "bench", "prompt": ids})).unwrap();
    c.bench_function("parse/20000_token_ids", |b| {
        b.iter(|| GenerationRequest::parse(Endpoint::Completions, black_box(&body)).unwrap())
    });
}

criterion_group!(benches, parse, parse_many_turns);
criterion_main!(benches);
