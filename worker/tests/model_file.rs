//! The default model file: metadata, tokenizer (against llama.cpp's ids), chat template.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvgate_worker::model::template::TemplateMessage;
use kvgate_worker::model::ModelFile;
use std::path::PathBuf;

/// The default model, fetched by `scripts/fetch-model` (the test command runs it).
pub fn default_model() -> PathBuf {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        path.exists(),
        "{} is missing: run scripts/fetch-model",
        path.display()
    );
    path
}

#[test]
fn hyperparameters_match_smollm2() {
    let m = ModelFile::open(&default_model()).unwrap();
    let p = &m.params;
    assert_eq!(
        (p.layers, p.hidden, p.ffn, p.heads, p.kv_heads, p.head_dim),
        (30, 576, 1536, 9, 3, 64)
    );
    assert_eq!(p.vocab_size, 49152);
    assert_eq!(p.rope_theta, 100000.0);
    assert_eq!(
        (m.tokenizer.bos_token_id, m.tokenizer.eos_token_id),
        (Some(1), Some(2))
    );
}

#[test]
fn chat_template_renders_chatml() {
    let m = ModelFile::open(&default_model()).unwrap();
    let t = m.template.as_ref().unwrap();
    let text = t
        .render(&[TemplateMessage {
            role: "user".into(),
            content: "Hi there".into(),
        }])
        .unwrap();
    assert!(
        text.starts_with("<|im_start|>system\n"),
        "the template's default system prompt: {text:?}"
    );
    assert!(
        text.ends_with("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"),
        "{text:?}"
    );
    let ids = m.tokenizer.encode(&text, true).unwrap();
    assert_eq!(ids[0], 1, "<|im_start|> is one special token");
    let plain = m.tokenizer.encode("<|im_start|>", false).unwrap();
    assert!(plain.len() > 1, "without special parsing it is text");
    assert_eq!(m.tokenizer.decode(&ids, false).unwrap(), text);
}

#[test]
fn token_ids_equal_llama_cpp() {
    // Recorded from llama-cpp-python 0.3.36 by tests/golden/record_tokens.py.
    let golden: serde_json::Value =
        serde_json::from_str(include_str!("golden/tokens.json")).unwrap();
    let m = ModelFile::open(&default_model()).unwrap();
    let mut checked = 0;
    for case in golden["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        for (key, special) in [("special", true), ("plain", false)] {
            let want: Vec<u32> = serde_json::from_value(case[key].clone()).unwrap();
            let got = m.tokenizer.encode(text, special).unwrap();
            assert_eq!(got, want, "{key} tokens of {text:?}");
            checked += 1;
        }
    }
    assert!(checked >= 40);
}
