//! The prompt model on the default GGUF: cached segment-wise tokenization equals the
//! tokenizer's own, and a `tokenizer.json` built from the GGUF tokenizes alike.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvgate_prompt::template::TemplateMessage;
use kvgate_prompt::PromptModel;
use proptest::prelude::*;
use std::path::PathBuf;
use std::sync::OnceLock;

fn model() -> &'static PromptModel {
    static MODEL: OnceLock<PromptModel> = OnceLock::new();
    MODEL.get_or_init(|| {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
        assert!(
            path.exists(),
            "{} is missing: run scripts/fetch-model",
            path.display()
        );
        PromptModel::open(&path).unwrap()
    })
}

/// Pieces that stress segment boundaries: special tokens, their near misses, spaces and
/// newlines next to them, multi-byte characters, long runs that get cached.
const PIECES: &[&str] = &[
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|im_start",
    "<|",
    "|>",
    "<",
    " ",
    "\n",
    "  \n\n",
    "user",
    "system\n",
    "café naïve 日本語 😀",
    "12345",
    "You are a helpful assistant who answers questions about the history of Rome in detail. ",
    "fn main() { println!(\"hello\"); }\n",
];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]
    #[test]
    fn segment_wise_equals_whole(parts in prop::collection::vec(0..PIECES.len(), 0..24)) {
        let text: String = parts.iter().map(|&i| PIECES[i]).collect();
        let m = model();
        let whole = m.tokenizer.encode(&text, true).unwrap();
        prop_assert_eq!(&m.encode(&text).unwrap(), &whole, "cold {:?}", text);
        prop_assert_eq!(&m.encode(&text).unwrap(), &whole, "cached {:?}", text);
    }
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvgate-prompt-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn tokenizer_json_tokenizes_like_the_gguf() {
    let m = model();
    let dir = scratch("json");
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, m.tokenizer.to_json().unwrap()).unwrap();
    let config = serde_json::json!({
        "bos_token": m.tokenizer.token_string(m.tokenizer.bos_token_id),
        "eos_token": { "content": m.tokenizer.token_string(m.tokenizer.eos_token_id) },
        "chat_template": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n",
    });
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    let json = PromptModel::open(&path).unwrap();
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(json.tokenizer.bos_token_id, m.tokenizer.bos_token_id);
    assert_eq!(json.tokenizer.eos_token_id, m.tokenizer.eos_token_id);
    let text = "<|im_start|>user\nWhat is 12 + 30? Answer in full, café.<|im_end|>\n";
    assert_eq!(json.encode(text).unwrap(), m.encode(text).unwrap());
    let rendered = json
        .template
        .as_ref()
        .unwrap()
        .render(&[TemplateMessage {
            role: "user".into(),
            content: "hi".into(),
        }])
        .unwrap();
    // As in jinja2, the template's one trailing newline is dropped.
    assert_eq!(
        rendered,
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant"
    );
}

#[test]
fn bad_files_are_clear_errors() {
    let dir = scratch("bad");
    let json = dir.join("tokenizer.json");
    std::fs::write(&json, "{ not json").unwrap();
    let e = PromptModel::open(&json).err().unwrap().to_string();
    assert!(e.contains("tokenizer.json"), "{e}");
    let gguf = dir.join("model.gguf");
    std::fs::write(&gguf, b"GGUF").unwrap();
    let e = PromptModel::open(&gguf).err().unwrap().to_string();
    assert!(e.contains("truncated"), "{e}");
    let e = PromptModel::open(&dir.join("absent.gguf"))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("absent.gguf"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}
