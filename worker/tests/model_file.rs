//! The default model file: metadata, tokenizer (against llama.cpp's ids), chat template.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvgate_worker::model::template::TemplateMessage;
use kvgate_worker::model::ModelFile;
mod common;

use common::default_model;

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
        (
            m.prompt.tokenizer.bos_token_id,
            m.prompt.tokenizer.eos_token_id
        ),
        (Some(1), Some(2))
    );
}

#[test]
fn chat_template_renders_chatml() {
    let m = ModelFile::open(&default_model()).unwrap();
    let t = m.prompt.template.as_ref().unwrap();
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
    let ids = m.prompt.tokenizer.encode(&text, true).unwrap();
    assert_eq!(ids[0], 1, "<|im_start|> is one special token");
    let plain = m.prompt.tokenizer.encode("<|im_start|>", false).unwrap();
    assert!(plain.len() > 1, "without special parsing it is text");
    assert_eq!(m.prompt.tokenizer.decode(&ids, false).unwrap(), text);
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
            let got = m.prompt.tokenizer.encode(text, special).unwrap();
            assert_eq!(got, want, "{key} tokens of {text:?}");
            if special {
                // Segment by segment, cold and then from the cache.
                for pass in ["cold", "cached"] {
                    let got = m.prompt.encode(text).unwrap();
                    assert_eq!(got, want, "{pass} segment-wise tokens of {text:?}");
                }
            }
            checked += 1;
        }
    }
    assert!(checked >= 40);
}

#[test]
fn streaming_detokenisation_never_splits_a_character() {
    use kvgate_worker::server::detok::TextStream;
    let m = ModelFile::open(&default_model()).unwrap();
    let text = "emoji 😀🎉👍🏽, accents café naïve, CJK 日本語のテキスト, and a stop here.";
    let ids = m.prompt.tokenizer.encode(text, false).unwrap();
    // Byte-level tokens split multi-byte characters: some tokens alone are not valid UTF-8.
    assert!(ids.iter().any(|&t| m
        .prompt
        .tokenizer
        .decode(&[t], true)
        .unwrap()
        .contains('\u{FFFD}')));
    let mut stream = TextStream::new(vec![]);
    let mut out = String::new();
    for &t in &ids {
        let piece = stream.push(t, &m.prompt.tokenizer);
        assert!(
            !piece.contains('\u{FFFD}'),
            "released a broken character: {piece:?}"
        );
        out.push_str(&piece);
    }
    out.push_str(&stream.finish());
    assert_eq!(out, text);

    // A stop string ends the text before it, even when it spans tokens.
    let mut stopped = TextStream::new(vec!["a stop".into()]);
    let mut cut = String::new();
    for &t in &ids {
        cut.push_str(&stopped.push(t, &m.prompt.tokenizer));
        if stopped.stopped() {
            break;
        }
    }
    assert!(stopped.stopped());
    assert_eq!(cut, &text[..text.find("a stop").unwrap()]);
}

#[test]
fn token_bytes_spell_the_text_even_inside_a_character() {
    let m = ModelFile::open(&default_model()).unwrap();
    let text = "emoji 😀🎉👍🏽, accents café naïve, CJK 日本語, tabs\tand\nnewlines";
    let ids = m.prompt.tokenizer.encode(text, false).unwrap();
    let bytes: Vec<u8> = ids
        .iter()
        .flat_map(|&t| m.prompt.tokenizer.token_bytes(t))
        .collect();
    assert_eq!(String::from_utf8(bytes).unwrap(), text);
    // A control token is its own text.
    assert_eq!(m.prompt.tokenizer.token_bytes(1), b"<|im_start|>");
}
