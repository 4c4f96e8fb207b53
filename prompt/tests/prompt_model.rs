//! The prompt model on the default GGUF: cached segment-wise tokenization equals the
//! tokenizer's own, and a `tokenizer.json` built from the GGUF tokenizes alike.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvgate_prompt::gguf::{Gguf, Value};
use kvgate_prompt::template::TemplateMessage;
use kvgate_prompt::tokenizer::Tokenizer;
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

/// Pieces that stress the pre-tokenizer: whitespace of every kind in runs, contractions,
/// numerals of other scripts, marks, symbols, control bytes, characters of four bytes.
const WORD_PIECES: &[&str] = &[
    " ",
    "  ",
    "\t",
    "\n",
    "\r\n",
    "\u{a0}",
    "\u{3000}",
    "\u{2028}",
    "\u{85}",
    "\u{200b}",
    "'s",
    "'t",
    "'re",
    "'ve",
    "'m",
    "'ll",
    "'d",
    "'S",
    "'",
    "\"",
    "a",
    "Word",
    "éte",
    "ß",
    "日本",
    "한국어",
    "Ελλάδα",
    "\u{301}",
    "x\u{308}",
    "7",
    "2024",
    "½",
    "²",
    "٣",
    "Ⅻ",
    "𝟙",
    ".",
    "...",
    "!?",
    "()",
    "<",
    "|",
    ">",
    "-",
    "_",
    "=",
    "€",
    "😀",
    "👩‍💻",
    "\u{1fae8}",
    "\u{0}",
    "\u{6}",
    "\u{1d}",
    "\u{7f}",
    "\u{40000}",
    "\u{e000}",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|im_sta",
];

/// The default model's tokenizer with GPT-2's pre-tokenizer (numerals not split one by one).
fn gpt2_pre_tokenizer() -> &'static Tokenizer {
    static TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
        let mut gguf = Gguf::open(&path).unwrap();
        gguf.metadata
            .insert("tokenizer.ggml.pre".into(), Value::String("gpt2".into()));
        Tokenizer::from_gguf(&gguf).unwrap()
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]
    /// The direct pre-tokenizer gives the `tokenizers` crate's ids on any text, with and
    /// without special tokens parsed, for both pre-tokenizers a GGUF may name.
    #[test]
    fn direct_byte_level_equals_the_crates_pipeline(
        parts in prop::collection::vec(0..WORD_PIECES.len(), 0..32),
        noise in "\\PC{0,12}",
    ) {
        let text: String = parts.iter().map(|&i| WORD_PIECES[i]).chain([noise.as_str()]).collect();
        for (t, pre) in [(&model().tokenizer, "smollm"), (gpt2_pre_tokenizer(), "gpt2")] {
            for special in [true, false] {
                prop_assert_eq!(
                    t.encode(&text, special).unwrap(),
                    t.encode_reference(&text, special).unwrap(),
                    "{:?} pre-tokenizer {} parse_special {}", text, pre, special
                );
            }
        }
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

fn request(
    endpoint: kvgate_protocol::openai::Endpoint,
    body: serde_json::Value,
) -> kvgate_protocol::openai::GenerationRequest {
    kvgate_protocol::openai::GenerationRequest::parse(endpoint, body.to_string().as_bytes())
        .unwrap()
}

#[test]
fn text_too_long_for_the_context_is_refused_before_tokenizing() {
    use kvgate_protocol::openai::Endpoint;
    let m = model();
    let most = 99 * m.tokenizer.max_token_bytes();
    let text = |n: usize| "a".repeat(n);
    let chat = |n: usize| {
        request(
            Endpoint::Chat,
            serde_json::json!({"model": "m", "messages": [{"role": "user", "content": text(n)}]}),
        )
    };
    let e = m
        .prompt_ids(Endpoint::Chat, &chat(most + 1), 100)
        .unwrap_err();
    assert!(e.message.contains("bytes of text"), "{}", e.message);
    assert_eq!(e.param.as_deref(), Some("messages"));
    // Within the byte bound, the token count decides.
    let e = m
        .prompt_ids(Endpoint::Chat, &chat(most - 200), 100)
        .unwrap_err();
    assert!(
        e.message.contains("maximum context length is 100"),
        "{}",
        e.message
    );
    let ok = m.prompt_ids(Endpoint::Chat, &chat(10), 100).unwrap();
    assert!(ok.0.len() < 100);
    let completion = request(
        Endpoint::Completions,
        serde_json::json!({"model": "m", "prompt": [text(most + 1)]}),
    );
    let e = m
        .prompt_ids(Endpoint::Completions, &completion, 100)
        .unwrap_err();
    assert_eq!(e.param.as_deref(), Some("prompt"));
    let tokens = request(
        Endpoint::Completions,
        serde_json::json!({"model": "m", "prompt": vec![17u32; 100]}),
    );
    assert!(m.prompt_ids(Endpoint::Completions, &tokens, 100).is_err());
    assert!(m.prompt_ids(Endpoint::Completions, &tokens, 101).is_ok());
}

#[test]
fn token_ids_outside_the_vocabulary_are_refused_in_every_layout() {
    use kvgate_protocol::openai::Endpoint;
    let m = model();
    for prompt in [
        serde_json::json!([5, 4_000_000]),
        serde_json::json!([[5, 4_000_000]]),
    ] {
        let r = request(
            Endpoint::Completions,
            serde_json::json!({"model": "m", "prompt": prompt}),
        );
        let e = m.prompt_ids(Endpoint::Completions, &r, 1000).unwrap_err();
        assert!(
            e.message.contains("outside the vocabulary"),
            "{}",
            e.message
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]
    /// Within a budget the ids are the tokenizer's own, or none when the text is larger
    /// than the budget (only text no cache holds is counted).
    #[test]
    fn within_a_budget_the_ids_are_the_whole_ones_or_none(
        parts in prop::collection::vec(0..PIECES.len(), 0..24),
        budget in 0usize..300,
    ) {
        let text: String = parts.iter().map(|&i| PIECES[i]).collect();
        let m = model();
        let whole = m.tokenizer.encode(&text, true).unwrap();
        let mut left = budget;
        match m.encode_within(&text, &mut left).unwrap() {
            Some(ids) => {
                prop_assert_eq!(&ids, &whole, "{:?}", text);
                prop_assert!(budget - left <= text.len());
            }
            None => prop_assert!(text.len() > budget, "{} bytes refused within {}", text.len(), budget),
        }
    }
}

/// A new user turn behind a system prompt seen before is tokenized within a small budget;
/// the first request, whose system prompt no cache holds yet, is not.
#[test]
fn a_new_turn_behind_a_cached_system_prompt_fits_a_small_budget() {
    use kvgate_protocol::openai::{Endpoint, GenerationRequest};
    let m = model();
    let system = PIECES[14].repeat(100);
    let chat = |n: u32| {
        let body = serde_json::json!({"model": "m", "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": format!("Question {n}: say ok.")}]});
        GenerationRequest::parse(Endpoint::Chat, body.to_string().as_bytes()).unwrap()
    };
    let budget = 2 << 10;
    assert!(m
        .prompt_ids_within(Endpoint::Chat, &chat(1), 8192, budget)
        .unwrap()
        .is_none());
    let (first, _) = m.prompt_ids(Endpoint::Chat, &chat(1), 8192).unwrap();
    let within = m
        .prompt_ids_within(Endpoint::Chat, &chat(2), 8192, budget)
        .unwrap();
    let (second, _) = within.expect("only the new turn is tokenized");
    assert_eq!(
        second,
        m.tokenizer
            .encode(
                &m.template
                    .as_ref()
                    .unwrap()
                    .render(&[
                        TemplateMessage {
                            role: "system".into(),
                            content: system.clone()
                        },
                        TemplateMessage {
                            role: "user".into(),
                            content: "Question 2: say ok.".into()
                        },
                    ])
                    .unwrap(),
                true
            )
            .unwrap()
    );
    assert_eq!(first.len(), second.len());
}

/// A conversation of many short turns costs its rendering against the budget too: one whose
/// text fits but whose messages do not is left to a thread that may stall, before it is
/// rendered; within a budget that covers both, its ids are the whole ones.
#[test]
fn many_short_turns_spend_the_budget_on_their_rendering() {
    use kvgate_protocol::openai::{Endpoint, GenerationRequest};
    let m = model();
    let chat = |turns: usize| {
        let messages: Vec<_> = (0..turns)
            .map(|k| serde_json::json!({"role": if k % 2 == 0 { "user" } else { "assistant" }, "content": format!("ok {k}")}))
            .collect();
        let body = serde_json::json!({"model": "m", "messages": messages});
        GenerationRequest::parse(Endpoint::Chat, body.to_string().as_bytes()).unwrap()
    };
    let budget = 2 << 10;
    let over = budget / kvgate_prompt::RENDER_BYTES_PER_MESSAGE + 1;
    let long = chat(over);
    let text_bytes: usize = (0..over).map(|k| format!("ok {k}").len() + 16).sum();
    assert!(text_bytes < budget, "the text alone fits");
    assert!(m
        .prompt_ids_within(Endpoint::Chat, &long, 8192, budget)
        .unwrap()
        .is_none());
    let short = chat(over / 2);
    let (within, _) = m
        .prompt_ids_within(Endpoint::Chat, &short, 8192, budget)
        .unwrap()
        .expect("half as many turns fit");
    assert_eq!(
        within,
        m.prompt_ids(Endpoint::Chat, &short, 8192).unwrap().0
    );
    let (whole, _) = m
        .prompt_ids_within(Endpoint::Chat, &long, 8192, usize::MAX)
        .unwrap()
        .expect("no budget, no refusal");
    assert_eq!(whole, m.prompt_ids(Endpoint::Chat, &long, 8192).unwrap().0);
}

/// The GGUF's chat template rendered the plain way, its messages serialised into maps: what
/// the template's message objects must render alike.
fn reference_render(messages: &[(&str, &str)]) -> String {
    static ENV: OnceLock<minijinja::Environment<'static>> = OnceLock::new();
    let env = ENV.get_or_init(|| {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
        let gguf = Gguf::open(&path).unwrap();
        let source = gguf.get_str("tokenizer.chat_template").unwrap().to_string();
        let mut env = minijinja::Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .unwrap();
        env.set_syntax(syntax);
        env.add_template_owned("chat", source).unwrap();
        env
    });
    let messages: Vec<_> = messages
        .iter()
        .map(|(role, content)| serde_json::json!({"role": role, "content": content}))
        .collect();
    let m = model();
    let token = |id| m.tokenizer.token_string(id);
    env.get_template("chat")
        .unwrap()
        .render(minijinja::context! {
            messages => minijinja::Value::from(minijinja::value::Serde(&messages)),
            add_generation_prompt => true,
            bos_token => token(m.tokenizer.bos_token_id),
            eos_token => token(m.tokenizer.eos_token_id),
        })
        .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(100))]
    #[test]
    fn the_chat_template_renders_as_with_serialised_messages(
        messages in prop::collection::vec(
            (prop::sample::select(vec!["system", "user", "assistant"]), 0..PIECES.len(), 1..80usize),
            1..6,
        )
    ) {
        // Repeated, some conversations pass the length from which contents are spliced in.
        let contents: Vec<String> = messages.iter().map(|&(_, i, n)| PIECES[i].repeat(n)).collect();
        let messages: Vec<(&str, &str)> = messages
            .iter()
            .zip(&contents)
            .map(|(&(r, _, _), c)| (r, c.as_str()))
            .collect();
        let template = model().template.as_ref().unwrap();
        let ours = template
            .render(
                &messages
                    .iter()
                    .map(|&(role, content)| TemplateMessage { role: role.into(), content: content.into() })
                    .collect::<Vec<_>>(),
            )
            .unwrap();
        prop_assert_eq!(ours, reference_render(&messages));
    }
}
