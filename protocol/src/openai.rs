//! OpenAI-compatible request, response and streaming types (the fields kvgate and common load
//! generators use). Unknown request fields are ignored, as OpenAI-compatible servers do, so a
//! client's extensions pass through the gateway untouched.

mod either;

pub use crate::json_body::deserialize;
use crate::{ApiError, ErrorKind};
use serde::{Deserialize, Serialize};
use std::borrow::Cow;

/// A `POST /v1/chat/completions` (with `messages`) or `POST /v1/completions` (with `prompt`)
/// request. One type for both, with no flattening, so that a parse error names its field and a
/// large body is not buffered twice.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GenerationRequest {
    pub model: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub messages: Option<Vec<ChatMessage>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt: Option<Prompt>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub echo: bool,
    #[serde(default)]
    pub stream: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_options: Option<StreamOptions>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_completion_tokens: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<Stop>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ignore_eos: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_logprobs: Option<u32>,
    /// Choices to generate for the prompt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n: Option<u32>,
    /// Generation also stops after any of these token ids (vLLM's extension).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_token_ids: Option<Vec<u32>>,
    /// Fields that not every engine implements, kept as sent (see
    /// [`GenerationRequest::optional_fields_in_use`]): the gateway forwards the body unchanged
    /// to engines that honour them; kvgate's worker refuses what it cannot honour instead of
    /// ignoring it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub best_of: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frequency_penalty: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub presence_penalty: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repetition_penalty: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logit_bias: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_p: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_tokens: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub functions: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub function_call: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_format: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suffix: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guided_json: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guided_regex: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guided_choice: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guided_grammar: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub structured_outputs: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub audio: Option<serde_json::Value>,
    /// Prefill/decode disaggregation's hand-over (vLLM's field): asks a prefill worker to
    /// keep the prompt's K/V for a decode worker, or tells a decode worker where to pull it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_transfer_params: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub modalities: Option<serde_json::Value>,
}

/// The most top log-probabilities a request may ask for per token (vLLM's default limit).
pub const MAX_LOGPROBS: u32 = 20;

/// Which OpenAI endpoint a request came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completions,
}

impl Endpoint {
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
        }
    }
}

impl GenerationRequest {
    /// Parses and validates a request body for `endpoint`; errors name the field at fault.
    pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<GenerationRequest, ApiError> {
        let request: GenerationRequest = deserialize(body)?;
        request.validate(endpoint)?;
        Ok(request)
    }

    /// Checks what the endpoint requires: `messages` (non-empty) for chat, `prompt` for
    /// completions, and a non-empty `model`.
    pub fn validate(&self, endpoint: Endpoint) -> Result<(), ApiError> {
        let invalid = |message: &str, param: &str| {
            Err(ApiError::new(ErrorKind::InvalidRequest, message).with_param(param))
        };
        if self.model.trim().is_empty() {
            return invalid("`model` must not be empty", "model");
        }
        // A number too large for its type reads as infinity.
        for (name, value) in [("temperature", self.temperature), ("top_p", self.top_p)] {
            if value.is_some_and(|v| !v.is_finite()) {
                return invalid(&format!("`{name}` must be a finite number"), name);
            }
        }
        self.requested_logprobs(endpoint)?;
        match endpoint {
            Endpoint::Chat => match &self.messages {
                None => invalid("missing field `messages`", "messages"),
                Some(m) if m.is_empty() => {
                    invalid("`messages` must contain at least one message", "messages")
                }
                Some(_) => Ok(()),
            },
            Endpoint::Completions if self.prompt.is_none() => {
                invalid("missing field `prompt`", "prompt")
            }
            Endpoint::Completions => Ok(()),
        }
    }

    /// The output limit: `max_completion_tokens` (newer name) wins over `max_tokens`.
    pub fn max_output_tokens(&self) -> Option<u32> {
        self.max_completion_tokens.or(self.max_tokens)
    }

    /// How many top log-probabilities each output token should carry, if the request asks for
    /// logprobs at all. Chat takes `logprobs: true` with `top_logprobs: N`; completions take
    /// `logprobs: N`. N is at most [`MAX_LOGPROBS`].
    pub fn requested_logprobs(&self, endpoint: Endpoint) -> Result<Option<u32>, ApiError> {
        let invalid = |message: String, param: &str| {
            Err(ApiError::new(ErrorKind::InvalidRequest, message).with_param(param))
        };
        let n = match (endpoint, &self.logprobs) {
            (_, None | Some(serde_json::Value::Null)) => None,
            (Endpoint::Chat, Some(serde_json::Value::Bool(on))) => {
                on.then(|| self.top_logprobs.unwrap_or(0))
            }
            (Endpoint::Chat, Some(_)) => {
                return invalid(
                    "`logprobs` must be a boolean for chat completions".into(),
                    "logprobs",
                )
            }
            (Endpoint::Completions, Some(v)) => match v.as_u64() {
                Some(n) => Some(u32::try_from(n).unwrap_or(u32::MAX)),
                None => {
                    return invalid(
                        "`logprobs` must be a non-negative integer for completions".into(),
                        "logprobs",
                    )
                }
            },
        };
        if endpoint == Endpoint::Chat && self.top_logprobs.is_some() && n.is_none() {
            return invalid(
                "`top_logprobs` needs `logprobs: true`".into(),
                "top_logprobs",
            );
        }
        match n {
            Some(n) if n > MAX_LOGPROBS => {
                let param = if endpoint == Endpoint::Chat {
                    "top_logprobs"
                } else {
                    "logprobs"
                };
                invalid(
                    format!("at most {MAX_LOGPROBS} log-probabilities per token, asked for {n}"),
                    param,
                )
            }
            n => Ok(n),
        }
    }

    /// The optional fields that ask for something, by name with the value sent: set to
    /// anything but null or the value that means "off" (clients that send every field send
    /// those).
    pub fn optional_fields_in_use(&self) -> Vec<(&'static str, &serde_json::Value)> {
        use serde_json::Value;
        let number_is = |v: &Value, off: f64| v.as_f64() == Some(off);
        let none_or_auto = |v: &Value| matches!(v.as_str(), Some("none" | "auto"));
        let n = f64::from(self.n.unwrap_or(1));
        type Off<'a> = &'a dyn Fn(&Value) -> bool;
        let fields: [(&'static str, &Option<Value>, Off<'_>); 20] = [
            ("best_of", &self.best_of, &|v| {
                number_is(v, 1.0) || number_is(v, n)
            }),
            ("frequency_penalty", &self.frequency_penalty, &|v| {
                number_is(v, 0.0)
            }),
            ("presence_penalty", &self.presence_penalty, &|v| {
                number_is(v, 0.0)
            }),
            ("repetition_penalty", &self.repetition_penalty, &|v| {
                number_is(v, 1.0)
            }),
            ("min_p", &self.min_p, &|v| number_is(v, 0.0)),
            ("min_tokens", &self.min_tokens, &|v| number_is(v, 0.0)),
            ("logit_bias", &self.logit_bias, &|v| {
                v.as_object().is_some_and(|o| o.is_empty())
            }),
            ("tools", &self.tools, &|v| {
                v.as_array().is_some_and(Vec::is_empty)
            }),
            ("functions", &self.functions, &|v| {
                v.as_array().is_some_and(Vec::is_empty)
            }),
            ("tool_choice", &self.tool_choice, &none_or_auto),
            ("function_call", &self.function_call, &none_or_auto),
            ("response_format", &self.response_format, &|v| {
                v.get("type").and_then(Value::as_str) == Some("text")
            }),
            ("suffix", &self.suffix, &|v| v.as_str() == Some("")),
            ("modalities", &self.modalities, &|v| {
                *v == serde_json::json!(["text"])
            }),
            ("guided_json", &self.guided_json, &|_| false),
            ("guided_regex", &self.guided_regex, &|_| false),
            ("guided_choice", &self.guided_choice, &|_| false),
            ("guided_grammar", &self.guided_grammar, &|_| false),
            ("structured_outputs", &self.structured_outputs, &|_| false),
            ("audio", &self.audio, &|_| false),
        ];
        fields
            .into_iter()
            .filter_map(|(name, value, off)| match value {
                Some(v) if !v.is_null() && !off(v) => Some((name, v)),
                _ => None,
            })
            .collect()
    }

    /// Whether a streamed response should end with a usage chunk.
    pub fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage)
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// `stop`: one string or several.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

impl Stop {
    pub fn as_slice(&self) -> &[String] {
        match self {
            Stop::One(s) => std::slice::from_ref(s),
            Stop::Many(v) => v,
        }
    }
}

/// `prompt`: a string, a list of strings, token ids, or a list of token-id lists (read by
/// its first element: `openai/either.rs`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<MessageContent>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// Message content: a string, or a list of typed parts of which kvgate reads the text ones
/// (read in one pass: `openai/either.rs`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

impl MessageContent {
    /// The length in bytes of [`MessageContent::text`], without making it.
    pub fn text_len(&self) -> usize {
        match self {
            MessageContent::Text(s) => s.len(),
            MessageContent::Parts(parts) => parts
                .iter()
                .filter_map(|p| p.text.as_ref())
                .map(String::len)
                .sum(),
        }
    }

    /// The text of the content, parts joined without separators (a copy only for parts).
    pub fn text(&self) -> Cow<'_, str> {
        match self {
            MessageContent::Text(s) => Cow::Borrowed(s),
            MessageContent::Parts(parts) => Cow::Owned(
                parts
                    .iter()
                    .filter_map(|p| p.text.as_deref())
                    .collect::<Vec<_>>()
                    .concat(),
            ),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
}

impl Usage {
    pub fn new(prompt_tokens: u32, completion_tokens: u32, cached_tokens: u32) -> Self {
        Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: Some(PromptTokensDetails { cached_tokens }),
        }
    }

    /// Adds one choice's usage to a request's: the prompt is counted once, every choice's
    /// completion tokens add up.
    pub fn add_choice(total: &mut Option<Usage>, choice: Usage) {
        match total {
            None => *total = Some(choice),
            Some(t) => {
                t.completion_tokens += choice.completion_tokens;
                t.total_tokens += choice.completion_tokens;
            }
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromptTokensDetails {
    pub cached_tokens: u32,
}

/// `GET /v1/models`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelList {
    pub object: String,
    pub data: Vec<ModelCard>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelCard {
    pub id: String,
    pub object: String,
    #[serde(default)]
    pub created: u64,
    #[serde(default)]
    pub owned_by: String,
}

impl ModelList {
    pub fn new(ids: impl IntoIterator<Item = String>) -> Self {
        ModelList {
            object: "list".into(),
            data: ids
                .into_iter()
                .map(|id| ModelCard {
                    id,
                    object: "model".into(),
                    created: 0,
                    owned_by: "kvgate".into(),
                })
                .collect(),
        }
    }
}

/// One server-sent event carrying `data`.
pub fn sse_event(data: &str) -> String {
    format!("data: {data}\n\n")
}

/// The event that ends an OpenAI stream.
pub const SSE_DONE: &str = "data: [DONE]\n\n";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_fields_load_generators_send() {
        let body = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],
            "stream":true,"stream_options":{"include_usage":true},"max_completion_tokens":7,
            "ignore_eos":true,"seed":3,"stop":["x","y"],"user":"u","unknown_field":1}"#;
        let r: GenerationRequest = serde_json::from_str(body).unwrap();
        assert!(r.stream && r.include_usage() && r.ignore_eos);
        assert_eq!(r.max_output_tokens(), Some(7));
        assert_eq!(
            r.stop.as_ref().map(Stop::as_slice),
            Some(&["x".into(), "y".into()][..])
        );
        let messages = r.messages.as_deref().unwrap_or_default();
        assert_eq!(
            messages[0].content.as_ref().map(MessageContent::text),
            Some("hi".into())
        );
        assert!(r.validate(Endpoint::Chat).is_ok());
        assert_eq!(
            r.validate(Endpoint::Completions)
                .unwrap_err()
                .param
                .as_deref(),
            Some("prompt")
        );
    }

    #[test]
    fn numbers_too_large_for_their_type_are_refused() {
        // Found by fuzzing: 1e39 read as an f32 is infinity, which wrote back as null.
        let body = format!(
            r#"{{"model":"m","prompt":"p","temperature":5{}.2}}"#,
            "5".repeat(60)
        );
        let e = GenerationRequest::parse(Endpoint::Completions, body.as_bytes()).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("temperature"));
        let body = r#"{"model":"m","prompt":"p","top_p":1e39}"#;
        let e = GenerationRequest::parse(Endpoint::Completions, body.as_bytes()).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("top_p"));
    }

    #[test]
    fn prompt_takes_every_openai_form() {
        let parse = |p: &str| {
            serde_json::from_str::<GenerationRequest>(&format!(r#"{{"model":"m","prompt":{p}}}"#))
                .map(|r| r.prompt.unwrap_or(Prompt::Text(String::new())))
        };
        assert_eq!(parse(r#""a""#).unwrap(), Prompt::Text("a".into()));
        assert_eq!(
            parse(r#"["a","b"]"#).unwrap(),
            Prompt::Texts(vec!["a".into(), "b".into()])
        );
        assert_eq!(parse("[1,2]").unwrap(), Prompt::Tokens(vec![1, 2]));
        assert_eq!(
            parse("[[1],[2]]").unwrap(),
            Prompt::TokenLists(vec![vec![1], vec![2]])
        );
        assert!(parse("5").is_err());
    }

    #[test]
    fn content_parts_join_their_text() {
        let m: ChatMessage = serde_json::from_str(
            r#"{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url"},{"type":"text","text":"b"}]}"#,
        )
        .unwrap();
        assert_eq!(m.content.as_ref().map(|c| c.text()), Some("ab".into()));
    }

    #[test]
    fn optional_fields_are_in_use_unless_null_or_off() {
        let fields = |extra: &str| {
            let r: GenerationRequest =
                serde_json::from_str(&format!(r#"{{"model":"m","prompt":"p"{extra}}}"#)).unwrap();
            r.optional_fields_in_use()
                .into_iter()
                .map(|(name, _)| name)
                .collect::<Vec<_>>()
        };
        let off = r#","frequency_penalty":0,"presence_penalty":0.0,"repetition_penalty":1,
            "logit_bias":{},"tools":[],"tool_choice":"none","response_format":{"type":"text"},
            "suffix":"","best_of":1,"guided_json":null,"modalities":["text"]"#;
        assert_eq!(fields(off), Vec::<&str>::new());
        assert_eq!(fields(r#","n":3,"best_of":3"#), Vec::<&str>::new());
        let on = r#","frequency_penalty":0.5,"tools":[{"type":"function"}],"best_of":4,
            "response_format":{"type":"json_object"},"guided_regex":"a+","logit_bias":{"5":1}"#;
        assert_eq!(
            fields(on),
            [
                "best_of",
                "frequency_penalty",
                "logit_bias",
                "tools",
                "response_format",
                "guided_regex"
            ]
        );
    }

    #[test]
    fn usage_reports_cached_tokens() {
        let v = serde_json::to_value(Usage::new(10, 5, 8)).unwrap();
        assert_eq!(v["total_tokens"], 15);
        assert_eq!(v["prompt_tokens_details"]["cached_tokens"], 8);
    }
}
