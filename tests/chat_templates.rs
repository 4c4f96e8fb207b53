//! A token-mode gateway and its model's chat template: a conversation the template refuses is
//! answered 400 before it is forwarded, as the engine would answer it; a template calling what
//! the gateway's renderer lacks is the gateway's limit, not the request's fault, so the request
//! is routed by its text and forwarded.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use kvgate_worker::model::PromptModel;

/// Token mode for `MODEL` with the default model's tokenizer and `template` as its chat
/// template (a `tokenizer.json` and its `tokenizer_config.json` in `dir`).
fn token_mode_with_template(dir: &std::path::Path, template: &str) -> String {
    let gguf = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let model = PromptModel::open(&gguf).unwrap();
    let json = dir.join("tokenizer.json");
    std::fs::write(&json, model.tokenizer.to_json().unwrap()).unwrap();
    let config = serde_json::json!({ "chat_template": template });
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    format!(
        "threads: 1\ntokenizers:\n  - model: {MODEL}\n    path: \"{}\"\n",
        json.display()
    )
}

fn conversation(role: &str) -> serde_json::Value {
    serde_json::json!({
        "model": MODEL,
        "messages": [{"role": role, "content": "Hello there"}],
        "max_tokens": 4,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_the_template_refuses_is_answered_400_without_forwarding() {
    let dir = tempfile::tempdir().unwrap();
    let template = "{% if messages[0].role == 'tool' %}{{ raise_exception('a tool message cannot come first') }}{% endif %}\
        {% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content.strip() }}<|im_end|>\n{% endfor %}";
    let w = Worker::start(&[]).await;
    let gw = Gateway::start(&[&w], &token_mode_with_template(dir.path(), template)).await;
    let (status, body) = post(&gw.url(), "/v1/chat/completions", &conversation("tool")).await;
    assert_eq!(status, 400, "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("cannot come first"), "{message}");
    assert_eq!(body["error"]["param"], "messages");
    assert_eq!(w.stats().await["requests"], 0, "the worker saw it");
    // A conversation it accepts, through the Python string method it calls, goes through.
    let (status, body) = post(&gw.url(), "/v1/chat/completions", &conversation("user")).await;
    assert_eq!(status, 200, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_calling_what_the_renderer_lacks_routes_the_request_by_its_text() {
    let dir = tempfile::tempdir().unwrap();
    // `casefold` is a Python string method minijinja does not have; jinja2 (vLLM) does.
    let template = "{% for m in messages %}{{ m.role }}: {{ m.content.casefold() }}\n{% endfor %}";
    let w = Worker::start(&[]).await;
    let gw = Gateway::start(&[&w], &token_mode_with_template(dir.path(), template)).await;
    for _ in 0..2 {
        let (status, body) = post(&gw.url(), "/v1/chat/completions", &conversation("user")).await;
        assert_eq!(status, 200, "{body}");
    }
    assert_eq!(w.stats().await["requests"], 2);
}
