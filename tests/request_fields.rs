//! Request fields over HTTP: the worker implements `n` (the prompt's blocks shared between the
//! choices) and `stop_token_ids`, refuses what it does not implement naming the field (never a
//! 200 as if honoured), and the gateway passes every field through to the engine untouched.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;

fn base() -> serde_json::Value {
    serde_json::json!({ "model": MODEL, "prompt": "Once upon a time", "max_tokens": 6, "ignore_eos": true, "seed": 7 })
}

fn with(field: &str, value: serde_json::Value) -> serde_json::Value {
    let mut body = base();
    body[field] = value;
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_have_their_own_index_and_share_the_prompt_blocks() {
    let w = SimWorker::start(&["--time-scale", "0.01"]).await;
    // 160 prompt tokens: 9 full blocks the later choices find cached (never the last token).
    let prompt: Vec<u32> = (0..160).map(|i| 300 + i).collect();
    let body = serde_json::json!({ "model": MODEL, "prompt": prompt, "max_tokens": 5, "ignore_eos": true, "seed": 3, "n": 3 });
    let before = w.get("/stats").await["engine"]["cached_prompt_tokens"]
        .as_u64()
        .unwrap();
    let (s, v) = post(&w.url(), "/v1/completions", &body).await;
    assert_eq!(s, 200, "{v}");
    let choices = v["choices"].as_array().unwrap();
    let indices: Vec<u64> = choices
        .iter()
        .map(|c| c["index"].as_u64().unwrap())
        .collect();
    assert_eq!(indices, [0, 1, 2]);
    assert!(choices.iter().all(|c| c["finish_reason"] == "length"));
    let texts: std::collections::HashSet<&str> = choices
        .iter()
        .map(|c| c["text"].as_str().unwrap())
        .collect();
    assert!(texts.len() > 1, "one seed per choice: {v}");
    assert_eq!(v["usage"]["prompt_tokens"], 160, "the prompt counts once");
    assert_eq!(v["usage"]["completion_tokens"], 15);
    let after = w.get("/stats").await["engine"]["cached_prompt_tokens"]
        .as_u64()
        .unwrap();
    assert_eq!(
        after - before,
        2 * 144,
        "choices 1 and 2 reuse the prompt's blocks"
    );

    let mut streamed = serde_json::json!({ "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "ignore_eos": true, "n": 2, "stream": true, "stream_options": {"include_usage": true} });
    let raw = client()
        .post(format!("{}/v1/chat/completions", w.url()))
        .json(&streamed)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let events: Vec<serde_json::Value> = raw
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let finished: Vec<u64> = events
        .iter()
        .filter(|e| e["choices"][0]["finish_reason"].is_string())
        .map(|e| e["choices"][0]["index"].as_u64().unwrap())
        .collect();
    let mut sorted = finished.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, [0, 1], "each choice finishes once: {raw}");
    let usage: Vec<&serde_json::Value> = events.iter().filter(|e| e["usage"].is_object()).collect();
    assert_eq!(usage.len(), 1, "{raw}");
    assert_eq!(usage[0]["usage"]["completion_tokens"], 8);
    assert!(raw.trim_end().ends_with("data: [DONE]"), "{raw}");
    assert_eq!(raw.matches("[DONE]").count(), 1);

    streamed["n"] = 17.into();
    let (s, e) = post(&w.url(), "/v1/chat/completions", &streamed).await;
    assert_eq!((s, e["error"]["param"].as_str()), (400, Some("n")), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_token_ids_end_the_output() {
    let w = SimWorker::start(&["--time-scale", "0.01"]).await;
    let (_, full) = post(&w.url(), "/v1/completions", &with("logprobs", 0.into())).await;
    let third = full["choices"][0]["logprobs"]["tokens"][2]
        .as_str()
        .unwrap()
        .to_string();
    let (_, ids) = post(
        &w.url(),
        "/tokenize",
        &serde_json::json!({ "prompt": third, "add_special_tokens": false }),
    )
    .await;
    let ids = ids["tokens"].as_array().unwrap().clone();
    assert_eq!(ids.len(), 1, "the third token's text is one token: {ids:?}");
    let (s, v) = post(
        &w.url(),
        "/v1/completions",
        &with("stop_token_ids", serde_json::json!([ids[0]])),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert!(
        v["usage"]["completion_tokens"].as_u64().unwrap() <= 3,
        "{v}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fields_the_worker_does_not_implement_are_refused_by_name() {
    let w = SimWorker::start(&["--time-scale", "0.01"]).await;
    let refused = [
        (
            "tools",
            serde_json::json!([{"type": "function", "function": {"name": "f"}}]),
        ),
        (
            "response_format",
            serde_json::json!({"type": "json_object"}),
        ),
        ("frequency_penalty", serde_json::json!(0.5)),
        ("presence_penalty", serde_json::json!(-1)),
        ("repetition_penalty", serde_json::json!(1.2)),
        ("logit_bias", serde_json::json!({"50": 10})),
        ("best_of", serde_json::json!(3)),
        ("echo", serde_json::json!(true)),
        ("suffix", serde_json::json!("end")),
        ("guided_json", serde_json::json!({"type": "object"})),
        ("top_k", serde_json::json!(-5)),
        ("n", serde_json::json!(0)),
    ];
    for (field, value) in refused {
        let (s, e) = post(&w.url(), "/v1/completions", &with(field, value.clone())).await;
        assert_eq!(s, 400, "{field}: {value} got {e}");
        assert_eq!(e["error"]["param"], field, "{e}");
    }
    let image = serde_json::json!({ "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}] });
    let (s, e) = post(&w.url(), "/v1/chat/completions", &image).await;
    assert_eq!(s, 400, "{e}");
    assert_eq!(e["error"]["param"], "messages[0].content[1].type");
    assert_eq!(
        w.get("/stats").await["engine"]["steps"],
        0,
        "nothing refused reached the engine"
    );
    // What clients that send every field send to mean "off" is accepted.
    let mut off = base();
    for (k, v) in [
        ("tools", serde_json::json!([])),
        ("tool_choice", serde_json::json!("none")),
        ("response_format", serde_json::json!({"type": "text"})),
        ("frequency_penalty", serde_json::json!(0)),
        ("presence_penalty", serde_json::json!(0.0)),
        ("logit_bias", serde_json::json!({})),
        ("best_of", serde_json::json!(1)),
        ("top_k", serde_json::json!(-1)),
        ("guided_json", serde_json::Value::Null),
    ] {
        off[k] = v;
    }
    let (s, v) = post(&w.url(), "/v1/completions", &off).await;
    assert_eq!(s, 200, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_forwards_fields_it_does_not_read_untouched() {
    let w = SimWorker::start(&["--time-scale", "0.01"]).await;
    let gw = Gateway::start(&[&w], "").await;
    // The gateway neither drops nor refuses `tools`: the engine behind it decides (here, the
    // kvgate worker refuses it by name).
    let body = with(
        "tools",
        serde_json::json!([{"type": "function", "function": {"name": "f"}}]),
    );
    let r = client()
        .post(format!("{}/v1/completions", gw.url()))
        .header("x-kvgate-debug", "1")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert!(
        r.headers().get("x-kvgate-replica").is_some(),
        "answered by the worker"
    );
    let e: serde_json::Value = r.json().await.unwrap();
    assert_eq!(e["error"]["param"], "tools", "{e}");
    let (s, v) = post(&gw.url(), "/v1/completions", &with("n", 2.into())).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["choices"].as_array().unwrap().len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_renders_chat_messages_as_chat_completions_does() {
    let w = SimWorker::start(&["--time-scale", "0.01"]).await;
    let messages = serde_json::json!([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello there"},
    ]);
    let (s, t) = post(
        &w.url(),
        "/tokenize",
        &serde_json::json!({ "messages": messages }),
    )
    .await;
    assert_eq!(s, 200, "{t}");
    let chat = serde_json::json!({"model": MODEL, "messages": messages, "max_tokens": 8});
    let (_, c) = post(&w.url(), "/v1/chat/completions", &chat).await;
    assert_eq!(t["count"], c["usage"]["prompt_tokens"], "{t} {c}");
    // The same ids as a token prompt: the same answer.
    let ids = serde_json::json!({"model": MODEL, "prompt": t["tokens"], "max_tokens": 8});
    let (_, p) = post(&w.url(), "/v1/completions", &ids).await;
    assert_eq!(
        p["choices"][0]["text"], c["choices"][0]["message"]["content"],
        "{p} {c}"
    );
    let both = serde_json::json!({ "prompt": "hi", "messages": messages });
    let (s, e) = post(&w.url(), "/tokenize", &both).await;
    assert_eq!(
        (s, e["error"]["param"].as_str()),
        (400, Some("prompt")),
        "{e}"
    );
}
