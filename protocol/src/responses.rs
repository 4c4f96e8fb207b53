//! OpenAI responses as kvgate's servers write them (the worker, and the test worker that
//! stands in for one): the response types, and one builder per response, so every chunk of a stream carries the same
//! id, model and creation time, and both servers answer in the same shape.

use crate::openai::{sse_event, Endpoint, Usage};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletionResponse {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatChoice {
    pub index: u32,
    pub message: AssistantMessage,
    #[serde(default)]
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<String>,
}

/// A chat choice's log-probabilities: one entry per output token.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatTokenLogprob {
    pub token: String,
    pub logprob: f32,
    /// The token's UTF-8 bytes (a token may hold part of a character).
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<TopLogprob>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

/// A completion choice's log-probabilities (the legacy layout: parallel lists).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<f32>,
    /// Per token: the most likely tokens' text and log-probability.
    pub top_logprobs: Vec<std::collections::BTreeMap<String, f32>>,
    /// Where each token starts in the choice's text, in bytes.
    pub text_offset: Vec<usize>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AssistantMessage {
    pub role: String,
    pub content: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletionChunk {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChunkChoice>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatChunkChoice {
    pub index: u32,
    pub delta: ChatDelta,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatDelta {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionResponse {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionChoice {
    pub index: u32,
    pub text: String,
    #[serde(default)]
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<String>,
}

/// Builds one response's chunks and bodies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Responder {
    pub endpoint: Endpoint,
    pub id: String,
    pub model: String,
    /// Unix seconds.
    pub created: u64,
}

impl Responder {
    /// A response created now.
    pub fn new(endpoint: Endpoint, id: String, model: String) -> Self {
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        Responder {
            endpoint,
            id,
            model,
            created,
        }
    }

    fn stream_object(&self) -> &'static str {
        match self.endpoint {
            Endpoint::Chat => "chat.completion.chunk",
            Endpoint::Completions => "text_completion",
        }
    }

    /// A streamed chat chunk of choice `index`, as an SSE event.
    pub fn chat_chunk(
        &self,
        index: u32,
        delta: ChatDelta,
        logprobs: Option<ChatLogprobs>,
        finish_reason: Option<&str>,
    ) -> String {
        self.event(&ChatCompletionChunk {
            id: self.id.clone(),
            object: self.stream_object().into(),
            created: self.created,
            model: self.model.clone(),
            choices: vec![ChatChunkChoice {
                index,
                delta,
                logprobs,
                finish_reason: finish_reason.map(str::to_string),
            }],
            usage: None,
        })
    }

    /// A streamed completions chunk of one choice, as an SSE event.
    pub fn completion_chunk(&self, choice: CompletionChoice) -> String {
        self.event(&self.completions(vec![choice], None))
    }

    /// The chunk with the request's usage and no choices, sent last when the request sets
    /// `stream_options.include_usage`, as an SSE event.
    pub fn usage_chunk(&self, usage: Usage) -> String {
        match self.endpoint {
            Endpoint::Chat => self.event(&ChatCompletionChunk {
                id: self.id.clone(),
                object: self.stream_object().into(),
                created: self.created,
                model: self.model.clone(),
                choices: Vec::new(),
                usage: Some(usage),
            }),
            Endpoint::Completions => self.event(&self.completions(Vec::new(), Some(usage))),
        }
    }

    /// The whole chat response.
    pub fn chat_response(&self, choices: Vec<ChatChoice>, usage: Usage) -> Vec<u8> {
        serde_json::to_vec(&ChatCompletionResponse {
            id: self.id.clone(),
            object: "chat.completion".into(),
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
        })
        .unwrap_or_default()
    }

    /// The whole completions response.
    pub fn completion_response(&self, choices: Vec<CompletionChoice>, usage: Usage) -> Vec<u8> {
        serde_json::to_vec(&self.completions(choices, Some(usage))).unwrap_or_default()
    }

    fn completions(
        &self,
        choices: Vec<CompletionChoice>,
        usage: Option<Usage>,
    ) -> CompletionResponse {
        CompletionResponse {
            id: self.id.clone(),
            object: "text_completion".into(),
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
        }
    }

    fn event(&self, value: &impl serde::Serialize) -> String {
        sse_event(&serde_json::to_string(value).unwrap_or_default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sse::SseParser;

    fn read(event: &str) -> serde_json::Value {
        let data = SseParser::default().push(event.as_bytes());
        serde_json::from_str(&data[0]).unwrap()
    }

    #[test]
    fn every_chunk_of_a_stream_names_the_same_response() {
        let r = Responder::new(Endpoint::Chat, "chatcmpl-1".into(), "m".into());
        let delta = ChatDelta {
            role: Some("assistant".into()),
            content: Some("hi".into()),
        };
        let first = read(&r.chat_chunk(0, delta, None, None));
        let usage = read(&r.usage_chunk(Usage::new(3, 1, 0)));
        for v in [&first, &usage] {
            assert_eq!(v["id"], "chatcmpl-1");
            assert_eq!(v["object"], "chat.completion.chunk");
            assert_eq!(v["created"], r.created);
        }
        assert_eq!(first["choices"][0]["delta"]["content"], "hi");
        assert_eq!(usage["choices"].as_array().unwrap().len(), 0);
        assert_eq!(usage["usage"]["prompt_tokens"], 3);
    }

    #[test]
    fn completions_read_back_as_the_protocol_types() {
        let r = Responder::new(Endpoint::Completions, "cmpl-1".into(), "m".into());
        let choice = CompletionChoice {
            index: 1,
            text: "x".into(),
            logprobs: None,
            finish_reason: Some("stop".into()),
        };
        let whole: CompletionResponse =
            serde_json::from_slice(&r.completion_response(vec![choice], Usage::new(1, 1, 0)))
                .unwrap();
        assert_eq!(whole.object, "text_completion");
        assert_eq!(whole.choices[0].index, 1);
        let usage = read(&r.usage_chunk(Usage::new(1, 1, 0)));
        assert_eq!(usage["object"], "text_completion");
    }
}
