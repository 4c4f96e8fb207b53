//! The default model's tokenizer on any text: the direct pre-tokenizer gives the `tokenizers`
//! crate's ids, tokenizing segment by segment (the cache the gateway and the worker use) gives
//! exactly the whole-text ids, cold and cached, and any chat request renders and tokenizes or
//! is refused.

use kvgate_prompt::PromptModel;
use kvgate_protocol::openai::{Endpoint, GenerationRequest};
use std::sync::OnceLock;

fn model() -> &'static PromptModel {
    static MODEL: OnceLock<PromptModel> = OnceLock::new();
    MODEL.get_or_init(|| {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../models/SmolLM2-135M-Instruct.Q4_1.gguf"
        );
        PromptModel::open(std::path::Path::new(path))
            .unwrap_or_else(|e| panic!("{path}: {e} (scripts/fetch-model fetches it)"))
    })
}

pub fn tokenizer(data: &[u8]) {
    let m = model();
    let text = String::from_utf8_lossy(data);
    let whole = m.tokenizer.encode(&text, true).unwrap();
    assert_eq!(whole, m.tokenizer.encode_reference(&text, true).unwrap());
    assert_eq!(m.encode(&text).unwrap(), whole, "cold");
    assert_eq!(m.encode(&text).unwrap(), whole, "cached");
    let plain = m.tokenizer.encode(&text, false).unwrap();
    assert_eq!(plain, m.tokenizer.encode_reference(&text, false).unwrap());
    let _ = m.tokenizer.decode(&plain, false);
    let body = serde_json::json!({ "model": "m", "messages": [{"role": "user", "content": text}] });
    let request = GenerationRequest::parse(Endpoint::Chat, body.to_string().as_bytes()).unwrap();
    let _ = m.prompt_ids(Endpoint::Chat, &request, 8192);
}
