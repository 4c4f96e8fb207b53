//! One OpenAI generation request: turning the body into engine input, and the engine's tokens
//! into OpenAI chunks or a whole response.

use super::detok::TextStream;
use super::metrics::Metrics;
use crate::engine::TokenOutput;
use crate::model::ModelFile;
use crate::request::{FinishReason, SamplingParams};
use kvgate_protocol::openai::{Endpoint, GenerationRequest, MessageContent, Usage, SSE_DONE};
use kvgate_protocol::responses::{
    AssistantMessage, ChatChoice, ChatDelta, ChatLogprobs, ChatTokenLogprob, CompletionChoice,
    CompletionLogprobs, Responder, TopLogprob,
};
use kvgate_protocol::{ApiError, ErrorKind};
use std::time::Instant;

/// Output limit of a completion that sets none (OpenAI's default).
const DEFAULT_COMPLETION_TOKENS: u32 = 16;
/// Most choices one request may ask for (`n`).
pub const MAX_CHOICES: u32 = 16;

/// A validated request, ready for the engine.
pub struct Prepared {
    pub endpoint: Endpoint,
    pub model: String,
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    pub stops: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// Choices to generate.
    pub n: u32,
    /// Prefill/decode hand-over, as sent (see `disagg`).
    pub kv_transfer_params: Option<serde_json::Value>,
}

fn invalid(message: String, param: &str) -> ApiError {
    ApiError::new(ErrorKind::InvalidRequest, message).with_param(param)
}

pub fn prepare(
    endpoint: Endpoint,
    body: &[u8],
    model: &ModelFile,
    served_name: &str,
    serves: impl FnOnce(&str) -> bool,
    max_model_len: usize,
) -> Result<Prepared, ApiError> {
    let r = GenerationRequest::parse(endpoint, body)?;
    if !serves(&r.model) {
        return Err(ApiError::new(
            ErrorKind::ModelNotFound,
            format!(
                "model `{}` is not served here (this worker serves `{served_name}`)",
                r.model
            ),
        )
        .with_param("model"));
    }
    let logprobs = r.requested_logprobs(endpoint)?;
    refuse_unimplemented(&r)?;
    let n = r.n.unwrap_or(1);
    if !(1..=MAX_CHOICES).contains(&n) {
        return Err(invalid(
            format!("n must be 1 to {MAX_CHOICES}, got {n}"),
            "n",
        ));
    }
    let top_k = r.top_k.unwrap_or(0);
    if top_k < -1 {
        return Err(invalid(
            format!("top_k must be -1 or 0 (off) or positive, got {top_k}"),
            "top_k",
        ));
    }
    let vocab = model.prompt.tokenizer.vocab_size();
    let stop_token_ids = r.stop_token_ids.clone().unwrap_or_default();
    if let Some(bad) = stop_token_ids.iter().find(|&&t| t >= vocab) {
        return Err(invalid(
            format!("token id {bad} is outside the vocabulary (size {vocab})"),
            "stop_token_ids",
        ));
    }
    let (prompt, _) = model.prompt.prompt_ids(endpoint, &r, max_model_len)?;
    let room = (max_model_len - prompt.len()) as u32;
    let max_tokens = match (r.max_output_tokens(), endpoint) {
        (Some(0), _) => return Err(invalid("max_tokens must be at least 1".into(), "max_tokens")),
        (Some(n), _) if n > room => {
            return Err(invalid(
                format!("this model's maximum context length is {max_model_len} tokens; the prompt has {} and max_tokens asks for {n} more", prompt.len()),
                "max_tokens",
            ))
        }
        (Some(n), _) => n,
        (None, Endpoint::Chat) => room,
        (None, Endpoint::Completions) => DEFAULT_COMPLETION_TOKENS.min(room),
    };
    let temperature = r.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(invalid(
            format!("temperature must be between 0 and 2, got {temperature}"),
            "temperature",
        ));
    }
    let top_p = r.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(invalid(
            format!("top_p must be in (0, 1], got {top_p}"),
            "top_p",
        ));
    }
    let stops = r
        .stop
        .as_ref()
        .map(|s| s.as_slice().to_vec())
        .unwrap_or_default();
    Ok(Prepared {
        endpoint,
        model: r.model.clone(),
        prompt,
        params: SamplingParams {
            max_tokens,
            temperature,
            top_p,
            top_k: top_k.max(0) as u32,
            seed: r.seed,
            stop_token_ids,
            ignore_eos: r.ignore_eos,
            logprobs,
        },
        stops,
        stream: r.stream,
        include_usage: r.include_usage(),
        n,
        kv_transfer_params: r.kv_transfer_params.clone(),
    })
}

/// Refuses what the request asks for and this worker does not do, naming the field, instead
/// of answering as if it had been honoured.
fn refuse_unimplemented(r: &GenerationRequest) -> Result<(), ApiError> {
    if let Some((name, value)) = r.optional_fields_in_use().first() {
        return Err(invalid(
            format!("`{name}` is not implemented by this worker (got {value}); leave it out or set it to null"),
            name,
        ));
    }
    if r.echo {
        return Err(invalid(
            "`echo` is not implemented by this worker".into(),
            "echo",
        ));
    }
    for (i, m) in r.messages.iter().flatten().enumerate() {
        let Some(MessageContent::Parts(parts)) = &m.content else {
            continue;
        };
        if let Some(j) = parts.iter().position(|p| p.kind != "text") {
            return Err(invalid(
                format!(
                    "content parts of type `{}` are not supported: this model reads text only",
                    parts[j].kind
                ),
                &format!("messages[{i}].content[{j}].type"),
            ));
        }
    }
    Ok(())
}

/// What a token turned into.
pub enum Piece {
    Text(String),
    /// The choice ended (the engine ended it, or a stop string did here).
    Finished {
        reason: &'static str,
        usage: Usage,
    },
}

/// Tracks one choice's output: text, timing metrics, usage.
pub struct Generation {
    /// The response this choice is part of.
    responder: Responder,
    /// The choice's index among the request's.
    pub index: u32,
    pub include_usage: bool,
    text: TextStream,
    /// Log-probabilities of tokens not yet sent (all of them, until a non-streamed response).
    logprobs: Vec<ChatTokenLogprob>,
    /// Bytes of output before the first token in `logprobs` (completions' `text_offset`).
    logprobs_offset: usize,
    arrived: Instant,
    last_token: Option<Instant>,
    sent_role: bool,
}

impl Generation {
    pub fn new(responder: Responder, index: u32, prepared: &Prepared) -> Generation {
        Generation {
            responder,
            index,
            include_usage: prepared.include_usage,
            text: TextStream::new(prepared.stops.clone()),
            logprobs: Vec::new(),
            logprobs_offset: 0,
            arrived: Instant::now(),
            last_token: None,
            sent_role: false,
        }
    }

    pub fn on_token(
        &mut self,
        token: &TokenOutput,
        model: &ModelFile,
        metrics: &Metrics,
    ) -> Vec<Piece> {
        let now = Instant::now();
        match self.last_token {
            None => Metrics::observe(&metrics.ttft, (now - self.arrived).as_secs_f64()),
            Some(last) => Metrics::observe(&metrics.itl, (now - last).as_secs_f64()),
        }
        self.last_token = Some(now);
        if let Some(lp) = &token.logprobs {
            let top = |&(id, logprob): &(u32, f32)| {
                let bytes = model.prompt.tokenizer.token_bytes(id);
                TopLogprob {
                    token: String::from_utf8_lossy(&bytes).into_owned(),
                    logprob,
                    bytes,
                }
            };
            let chosen = top(&(token.token, lp.logprob));
            self.logprobs.push(ChatTokenLogprob {
                token: chosen.token,
                logprob: chosen.logprob,
                bytes: chosen.bytes,
                top_logprobs: lp.top.iter().map(top).collect(),
            });
        }
        let mut pieces = Vec::new();
        let mut text = self.text.push(token.token, &model.prompt.tokenizer);
        let stop_string = self.text.stopped();
        if token.finished.is_some() || stop_string {
            text.push_str(&self.text.finish());
        }
        if !text.is_empty() {
            pieces.push(Piece::Text(text));
        }
        if token.finished.is_some() || stop_string {
            Metrics::observe(&metrics.e2e, (now - self.arrived).as_secs_f64());
            let reason = match token.finished {
                Some(FinishReason::Length) if !stop_string => "length",
                _ => "stop",
            };
            let usage = Usage::new(
                token.num_prompt_tokens as u32,
                token.num_output_tokens as u32,
                token.num_cached_tokens as u32,
            );
            pieces.push(Piece::Finished { reason, usage });
        }
        pieces
    }

    /// One streamed chunk of text.
    pub fn text_event(&mut self, text: String) -> String {
        match self.responder.endpoint {
            Endpoint::Chat => {
                let role = (!self.sent_role).then(|| "assistant".to_string());
                self.sent_role = true;
                let logprobs = self.take_chat_logprobs();
                let delta = ChatDelta {
                    role,
                    content: Some(text),
                };
                self.responder.chat_chunk(self.index, delta, logprobs, None)
            }
            Endpoint::Completions => {
                let choice = self.completion_choice(text, None);
                self.responder.completion_chunk(choice)
            }
        }
    }

    /// Log-probabilities of the tokens since the last chunk, in the chat layout.
    fn take_chat_logprobs(&mut self) -> Option<ChatLogprobs> {
        if self.logprobs.is_empty() {
            return None;
        }
        Some(ChatLogprobs {
            content: std::mem::take(&mut self.logprobs),
        })
    }

    /// Log-probabilities of the tokens since the last chunk, in the completions layout.
    fn take_completion_logprobs(&mut self) -> Option<CompletionLogprobs> {
        if self.logprobs.is_empty() {
            return None;
        }
        let mut out = CompletionLogprobs::default();
        for t in std::mem::take(&mut self.logprobs) {
            out.text_offset.push(self.logprobs_offset);
            self.logprobs_offset += t.bytes.len();
            out.tokens.push(t.token);
            out.token_logprobs.push(t.logprob);
            out.top_logprobs.push(
                t.top_logprobs
                    .into_iter()
                    .map(|x| (x.token, x.logprob))
                    .collect(),
            );
        }
        Some(out)
    }

    /// The choice's last chunk, with its finish reason.
    pub fn finish_event(&mut self, reason: &str) -> String {
        match self.responder.endpoint {
            Endpoint::Chat => {
                let logprobs = self.take_chat_logprobs();
                let delta = ChatDelta::default();
                self.responder
                    .chat_chunk(self.index, delta, logprobs, Some(reason))
            }
            Endpoint::Completions => {
                let choice = self.completion_choice(String::new(), Some(reason));
                self.responder.completion_chunk(choice)
            }
        }
    }

    /// What ends the stream once every choice has finished: the usage chunk if asked, `[DONE]`.
    pub fn closing_events(&self, usage: Usage) -> String {
        let mut out = String::new();
        if self.include_usage {
            out.push_str(&self.responder.usage_chunk(usage));
        }
        out.push_str(SSE_DONE);
        out
    }

    fn completion_choice(&mut self, text: String, finish: Option<&str>) -> CompletionChoice {
        CompletionChoice {
            index: self.index,
            text,
            logprobs: self.take_completion_logprobs(),
            finish_reason: finish.map(str::to_string),
        }
    }

    fn chat_choice(&mut self, text: String, reason: &str) -> ChatChoice {
        ChatChoice {
            index: self.index,
            message: AssistantMessage {
                role: "assistant".into(),
                content: text,
            },
            logprobs: self.take_chat_logprobs(),
            finish_reason: Some(reason.into()),
        }
    }
}

/// One finished choice of a whole (non-streamed) response.
pub struct Finished {
    pub text: String,
    pub reason: &'static str,
}

/// The whole non-streamed response: every choice, in index order, and the request's usage.
pub fn response(generations: &mut [Generation], finished: Vec<Finished>, usage: Usage) -> Vec<u8> {
    let Some(responder) = generations.first().map(|g| g.responder.clone()) else {
        return Vec::new();
    };
    let choices = generations.iter_mut().zip(finished);
    match responder.endpoint {
        Endpoint::Chat => responder.chat_response(
            choices
                .map(|(g, f)| g.chat_choice(f.text, f.reason))
                .collect(),
            usage,
        ),
        Endpoint::Completions => responder.completion_response(
            choices
                .map(|(g, f)| g.completion_choice(f.text, Some(f.reason)))
                .collect(),
            usage,
        ),
    }
}
