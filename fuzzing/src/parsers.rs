//! Parsers of what arrives from outside: OpenAI request bodies, SSE streams, gateway configs,
//! GGUF files, agents' reports and KV events, engines' Prometheus text.

use kvgate_protocol::kv_events::{KvEventBatch, KvSnapshot};
use kvgate_protocol::openai::{Endpoint, GenerationRequest};
use kvgate_protocol::sse::SseParser;
use kvgate_protocol::telemetry::TelemetryReport;

/// A request body for either endpoint: parsed or refused with an error naming a field, and
/// what the gateway and the worker read of a parsed one never panics.
pub fn openai_request(data: &[u8]) {
    for endpoint in [Endpoint::Chat, Endpoint::Completions] {
        if let Ok(r) = GenerationRequest::parse(endpoint, data) {
            let _ = r.requested_logprobs(endpoint);
            let _ = r.optional_fields_in_use();
            let _ = r.max_output_tokens();
            let _ = r.include_usage();
            for m in r.messages.iter().flatten() {
                let _ = m.content.as_ref().map(|c| c.text());
            }
            // What was read writes back and reads again the same.
            let again = serde_json::to_vec(&r).unwrap();
            let reread: GenerationRequest = serde_json::from_slice(&again).unwrap();
            assert_eq!(reread, r);
        }
    }
}

/// A stream cut into pieces anywhere (the first byte picks the piece size) yields the same
/// events as when it arrives whole.
pub fn sse_stream(data: &[u8]) {
    let Some((&size, stream)) = data.split_first() else {
        return;
    };
    let whole = SseParser::default().push(stream);
    let mut pieces = SseParser::default();
    let piecewise: Vec<String> = stream
        .chunks(usize::from(size % 16) + 1)
        .flat_map(|piece| pieces.push(piece))
        .collect();
    assert_eq!(piecewise, whole);
}

/// Any text as a gateway config: accepted or refused with errors, never a panic or a hang.
pub fn gateway_config(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = kvgate_router::config::parse_str(text);
    }
}

/// Any bytes as a GGUF file: read (and its tokenizer and template built) or refused.
pub fn gguf_file(data: &[u8]) {
    if let Ok(gguf) = kvgate_prompt::gguf::Gguf::read(data) {
        let _ = kvgate_prompt::PromptModel::from_gguf(&gguf);
    }
}

/// A report or KV-event batch as an agent would post it: parsed or refused, and a parsed one
/// applied to the gateway's precise index without a panic.
pub fn telemetry(data: &[u8]) {
    if let Ok(report) = serde_json::from_slice::<TelemetryReport>(data) {
        let _ = report.load.kv_usage();
        if let Some(update) = &report.kv {
            let mut index = kvgate_policies::PreciseIndex::default();
            let _ = index.apply(kvgate_policies::ReplicaId(0), update);
        }
    }
    if let Ok(batch) = serde_json::from_slice::<KvEventBatch>(data) {
        let mut held = std::collections::HashSet::new();
        kvgate_protocol::kv_events::apply(&mut held, &batch);
    }
    let _ = serde_json::from_slice::<KvSnapshot>(data);
}

/// An engine's `/metrics` text: every adapter reads it (a report or an error), never panics.
pub fn prometheus_text(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let metrics = kvgate_agent::adapter::Metrics::parse(&text);
    let _ = metrics.value("vllm:num_requests_running");
    for engine in ["kvgate", "vllm", "sglang", "llamacpp"] {
        let adapter = kvgate_agent::adapter::for_engine(engine).unwrap();
        let bodies: Vec<Option<String>> = adapter
            .paths()
            .iter()
            .map(|_| Some(text.clone().into_owned()))
            .collect();
        let _ = adapter.parse(&bodies);
    }
}
