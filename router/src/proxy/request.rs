//! Parsing a request body into what routing needs. The body itself is forwarded unchanged.

use crate::tokenizers::{TokenMode, TokenModes};
use kvgate_policies::{PolicyConfig, RequestFeatures};
use kvgate_protocol::openai::{Endpoint, GenerationRequest, Prompt};
use kvgate_protocol::{text_chunk_hashes, ApiError, ErrorKind, HashSeed};
use xxhash_rust::xxh3::xxh3_64_with_seed;

#[derive(Debug, Clone)]
pub struct RoutedRequest {
    pub model: String,
    pub features: RequestFeatures,
    /// The request's output limit, if it sets one.
    pub max_output_tokens: Option<u32>,
}

/// What a request is parsed with.
pub struct ParseContext<'a> {
    pub policy: &'a PolicyConfig,
    /// Models routed in token mode.
    pub tokenizers: &'a TokenModes,
    /// The request's `x-session-id`; without one, the body's `user` names the session.
    pub session_header: Option<&'a [u8]>,
    /// The gateway's clock, in microseconds.
    pub now_us: u64,
    /// The request's draw for a tie (`RequestFeatures::tie_draw`).
    pub tie_draw: u64,
}

/// Token mode for models with a tokenizer (the prompt's ids hashed into blocks as the worker
/// will), text mode otherwise.
pub fn parse(
    endpoint: Endpoint,
    body: &[u8],
    cx: &ParseContext<'_>,
) -> Result<RoutedRequest, ApiError> {
    parse_within(endpoint, body, cx, usize::MAX)?
        .ok_or_else(|| ApiError::new(ErrorKind::Internal, "unbounded tokenization stopped"))
}

/// As [`parse`] while a token-mode prompt's text found in no tokenization cache comes to at
/// most `tokenize_budget` bytes; `None` when more would have to be tokenized.
pub fn parse_within(
    endpoint: Endpoint,
    body: &[u8],
    cx: &ParseContext<'_>,
    tokenize_budget: usize,
) -> Result<Option<RoutedRequest>, ApiError> {
    let request = GenerationRequest::parse(endpoint, body)?;
    let session = cx
        .session_header
        .filter(|h| !h.is_empty())
        .or(request.user.as_deref().map(str::as_bytes))
        .map(|key| RequestFeatures::session_key(&request.model, key));
    let by_text = || features(&request.model, &text_of(endpoint, &request), cx.policy);
    let features = match cx.tokenizers.get(&request.model) {
        Some(mode) => match token_features(mode, endpoint, &request, cx.policy, tokenize_budget) {
            Ok(Some(features)) => features,
            Ok(None) => return Ok(None),
            // The gateway's own failure (a chat template calling what its renderer lacks) is
            // no fault of the request: routed by its text, the engine judges it.
            Err(e) if e.kind == ErrorKind::Internal => {
                warn_once_routed_by_text(&request.model, &e.message);
                by_text()
            }
            Err(e) => return Err(e),
        },
        None => by_text(),
    };
    Ok(Some(RoutedRequest {
        features: RequestFeatures {
            // A session's turns extend one prefix: its id places it on the ring, so sessions
            // that share only a system prompt spread over the fleet instead of all following
            // that prompt's owner (the prefix signal still favours replicas holding blocks).
            ring_key: session.unwrap_or(features.ring_key),
            session,
            now_ms: cx.now_us / 1_000,
            now_us: cx.now_us,
            tie_draw: cx.tie_draw,
            ..features
        },
        max_output_tokens: request.max_output_tokens(),
        model: request.model,
    }))
}

/// Says once per process that a token-mode model's request was routed by its text, and why.
fn warn_once_routed_by_text(model: &str, why: &str) {
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
        tracing::warn!(
            model,
            why,
            "request routed by its text, not its tokens (said once)"
        );
    }
}

/// Token-mode features: the prompt's block hashes, and the ring key from its first
/// `ring_key_chunks` blocks (the whole prompt when it is shorter than one block).
fn token_features(
    mode: &TokenMode,
    endpoint: Endpoint,
    request: &GenerationRequest,
    policy: &PolicyConfig,
    tokenize_budget: usize,
) -> Result<Option<RequestFeatures>, ApiError> {
    let prompt = &mode.prompt;
    let Some((ids, _)) =
        prompt.prompt_ids_within(endpoint, request, mode.context_length, tokenize_budget)?
    else {
        return Ok(None);
    };
    Ok(Some(RequestFeatures::from_tokens(
        &ids,
        mode.seed,
        mode.config.block_size,
        policy.ring_key_chunks,
    )))
}

/// The text hashed in text mode: chat messages' roles and contents, or the prompt.
fn text_of(endpoint: Endpoint, request: &GenerationRequest) -> Vec<u8> {
    match (&request.messages, &request.prompt) {
        (Some(messages), _) if endpoint == Endpoint::Chat => {
            let mut text = String::new();
            for m in messages {
                text.push_str(&m.role);
                text.push('\n');
                if let Some(c) = &m.content {
                    text.push_str(&c.text());
                }
                text.push('\n');
            }
            text.into_bytes()
        }
        (_, Some(prompt)) => prompt_bytes(prompt),
        _ => Vec::new(),
    }
}

/// Text-mode features: chained chunk hashes of the prompt, and the ring key from its first
/// `ring_key_chunks` chunks (the whole prompt when it is shorter than one chunk).
pub fn features(model: &str, text: &[u8], policy: &PolicyConfig) -> RequestFeatures {
    let seed = HashSeed::new(model, None, "text");
    let prefix_chunks = text_chunk_hashes(seed, text, policy.chunk_bytes);
    let ring_key = match prefix_chunks.len() {
        0 => xxh3_64_with_seed(text, seed.0),
        n => prefix_chunks[n.min(policy.ring_key_chunks) - 1],
    };
    RequestFeatures {
        // Byte-level BPE vocabularies average about 4 bytes a token on English text (and a
        // token-id prompt is hashed as 4 bytes a token).
        prompt_tokens: text.len().div_ceil(4) as u64,
        prefix_chunks,
        ring_key,
        ..RequestFeatures::default()
    }
}

fn prompt_bytes(prompt: &Prompt) -> Vec<u8> {
    let tokens = |ids: &[u32]| {
        ids.iter()
            .flat_map(|t| t.to_le_bytes())
            .collect::<Vec<u8>>()
    };
    match prompt {
        Prompt::Text(s) => s.as_bytes().to_vec(),
        Prompt::Texts(v) => v.concat().into_bytes(),
        Prompt::Tokens(ids) => tokens(ids),
        Prompt::TokenLists(lists) => lists.iter().flat_map(|l| tokens(l)).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(endpoint: Endpoint, body: &str) -> ApiError {
        let cx = ParseContext {
            policy: &PolicyConfig::default(),
            tokenizers: &TokenModes::new(),
            session_header: None,
            now_us: 0,
            tie_draw: 0,
        };
        parse(endpoint, body.as_bytes(), &cx).unwrap_err()
    }

    #[test]
    fn errors_name_the_field() {
        let e = err(Endpoint::Chat, r#"{"messages":[]}"#);
        assert_eq!(e.param.as_deref(), Some("model"));
        let e = err(Endpoint::Chat, r#"{"model":5,"messages":[]}"#);
        assert_eq!(e.param.as_deref(), Some("model"));
        assert!(e.message.contains("invalid type"), "{}", e.message);
        let e = err(
            Endpoint::Chat,
            r#"{"model":"m","messages":[{"content":"x"}]}"#,
        );
        assert_eq!(e.param.as_deref(), Some("messages[0].role"));
        let e = err(Endpoint::Chat, r#"{"model":"m","messages":[]}"#);
        assert_eq!(e.param.as_deref(), Some("messages"));
        let e = err(Endpoint::Completions, r#"{"model":"m","prompt":5}"#);
        assert_eq!(e.param.as_deref(), Some("prompt"));
        let e = err(Endpoint::Completions, r#"{"model":"m","#);
        assert!(e.message.contains("not valid JSON"));
        assert_eq!(e.status(), 400);
    }

    #[test]
    fn sessions_key_the_ring_and_other_requests_their_prefix() {
        let body = |q: &str| {
            let system = "s".repeat(2048);
            format!(
                r#"{{"model":"m","messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":"{q}"}}]}}"#
            )
        };
        let key = |session: Option<&str>, q: &str| {
            let cx = ParseContext {
                policy: &PolicyConfig::default(),
                tokenizers: &TokenModes::new(),
                session_header: session.map(str::as_bytes),
                now_us: 0,
                tie_draw: 0,
            };
            let parsed = parse(Endpoint::Chat, body(q).as_bytes(), &cx);
            parsed.map(|r| r.features.ring_key).unwrap_or_default()
        };
        assert_eq!(
            key(None, "a"),
            key(None, "b"),
            "same system prompt, same owner"
        );
        assert_ne!(
            key(Some("s1"), "a"),
            key(Some("s2"), "a"),
            "sessions spread"
        );
        assert_eq!(
            key(Some("s1"), "a"),
            key(Some("s1"), "a then b"),
            "a session keeps its key"
        );
    }

    #[test]
    fn shared_prefixes_share_ring_keys_and_chunks() {
        let policy = PolicyConfig::default();
        let system = "s".repeat(2048);
        let a = features("m", format!("{system}question a").as_bytes(), &policy);
        let b = features("m", format!("{system}question b").as_bytes(), &policy);
        assert_eq!(a.ring_key, b.ring_key);
        assert_eq!(a.prefix_chunks.len(), 8);
        assert_eq!(a.prefix_chunks, b.prefix_chunks);
        let short_a = features("m", b"hi", &policy);
        let short_b = features("m", b"ho", &policy);
        assert_ne!(short_a.ring_key, short_b.ring_key);
        assert_ne!(features("other", b"hi", &policy).ring_key, short_a.ring_key);
    }
}
