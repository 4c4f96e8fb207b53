//! The rule that turns an OpenAI request into prompt token ids: chat messages rendered with
//! the chat template, text prompts tokenized with special-token text parsed, token prompts
//! taken as they are. The worker and the gateway both apply it, so their block hashes agree.

use crate::template::RenderError;
use crate::PromptModel;
use kvgate_protocol::openai::{Endpoint, GenerationRequest, Prompt};
use kvgate_protocol::{ApiError, ErrorKind};
use std::borrow::Cow;

fn invalid(message: String, param: &str) -> ApiError {
    ApiError::new(ErrorKind::InvalidRequest, message).with_param(param)
}

/// What rendering one chat message through a template costs, in bytes of tokenization that
/// take as long (about 0.6 µs a message against 8.5 ns a byte: `cargo bench -p kvgate-prompt
/// --bench tokenize`), so that a budget bounds a conversation of many short turns too.
pub const RENDER_BYTES_PER_MESSAGE: usize = 64;

impl PromptModel {
    /// The prompt's token ids, and the request field they came from (for errors about them).
    /// A prompt must leave room for one output token in `context_length`; text too long for
    /// that whatever it says is refused before it is tokenized, since tokenizing costs time
    /// and about a hundred times the text's size in memory.
    pub fn prompt_ids(
        &self,
        endpoint: Endpoint,
        r: &GenerationRequest,
        context_length: usize,
    ) -> Result<(Vec<u32>, &'static str), ApiError> {
        self.prompt_ids_within(endpoint, r, context_length, usize::MAX)?
            .ok_or_else(|| ApiError::new(ErrorKind::Internal, "unbounded tokenization stopped"))
    }

    /// As [`PromptModel::prompt_ids`] while the prompt's text found in no cache comes to at
    /// most `budget` bytes, each chat message counted as [`RENDER_BYTES_PER_MESSAGE`] more;
    /// `None` as soon as more would have to be rendered or tokenized (a caller on a thread
    /// that must not stall hands the request to one that may).
    pub fn prompt_ids_within(
        &self,
        endpoint: Endpoint,
        r: &GenerationRequest,
        context_length: usize,
        mut budget: usize,
    ) -> Result<Option<(Vec<u32>, &'static str)>, ApiError> {
        if let (Endpoint::Chat, Some(messages)) = (endpoint, &r.messages) {
            let render = messages.len().saturating_mul(RENDER_BYTES_PER_MESSAGE);
            match budget.checked_sub(render) {
                Some(left) => budget = left,
                None => return Ok(None),
            }
        }
        let max_tokens = context_length.saturating_sub(1);
        let max_bytes = max_tokens.saturating_mul(self.tokenizer.max_token_bytes());
        let fits = |bytes: usize, param: &str| {
            if bytes <= max_bytes {
                return Ok(());
            }
            Err(invalid(
                format!(
                    "the prompt has {bytes} bytes of text, more than the {max_tokens} tokens a context length of {context_length} leaves for it can hold (a token of this model covers at most {} bytes)",
                    self.tokenizer.max_token_bytes()
                ),
                param,
            ))
        };
        let mut encode = |text: &str, param: &str| {
            fits(text.len(), param)?;
            self.encode_within(text, &mut budget)
                .map_err(|e| ApiError::new(ErrorKind::Internal, e.to_string()))
        };
        let tokens = |ids: &[u32]| {
            let vocab = self.tokenizer.vocab_size();
            match ids.iter().find(|&&t| t >= vocab) {
                Some(bad) => Err(invalid(
                    format!("token id {bad} is outside the vocabulary (size {vocab})"),
                    "prompt",
                )),
                None => Ok(Some(ids.to_vec())),
            }
        };
        let (ids, param) = match (endpoint, &r.messages, &r.prompt) {
            (Endpoint::Chat, Some(messages), _) => {
                let template = self.template.as_ref().ok_or_else(|| {
                    invalid(
                        "the model has no chat template; use /v1/completions".into(),
                        "messages",
                    )
                })?;
                // The rendered prompt holds every message's text: checked before a copy of
                // it is made.
                let text_bytes = messages
                    .iter()
                    .filter_map(|m| m.content.as_ref())
                    .map(|c| c.text_len())
                    .fold(0usize, usize::saturating_add);
                fits(text_bytes, "messages")?;
                let text = template
                    .render_each(messages.iter().map(|m| {
                        let content = m.content.as_ref().map_or(Cow::Borrowed(""), |c| c.text());
                        (m.role.as_str(), content)
                    }))
                    .map_err(|e| match e {
                        RenderError::Refused(m) => invalid(m, "messages"),
                        // Not the request's fault: an internal error, which a gateway routing
                        // by tokens answers by routing this request by its text instead.
                        RenderError::Unsupported(m) => ApiError::new(ErrorKind::Internal, m),
                    })?;
                (encode(&text, "messages")?, "messages")
            }
            (_, _, Some(Prompt::Text(text))) => (encode(text, "prompt")?, "prompt"),
            (_, _, Some(Prompt::Tokens(ids))) => (tokens(ids)?, "prompt"),
            (_, _, Some(Prompt::Texts(v))) if v.len() == 1 => (encode(&v[0], "prompt")?, "prompt"),
            (_, _, Some(Prompt::TokenLists(v))) if v.len() == 1 => (tokens(&v[0])?, "prompt"),
            (_, _, Some(_)) => {
                return Err(invalid(
                    "batched prompts are not supported: send one prompt per request".into(),
                    "prompt",
                ))
            }
            _ => return Err(invalid("missing field `prompt`".into(), "prompt")),
        };
        let Some(ids) = ids else {
            return Ok(None);
        };
        if ids.is_empty() {
            return Err(invalid("the prompt is empty".into(), param));
        }
        if ids.len() > max_tokens {
            return Err(invalid(
                format!(
                    "the prompt has {} tokens, but the maximum context length is {context_length} tokens (prompt plus at least one output token)",
                    ids.len()
                ),
                param,
            ));
        }
        Ok(Some((ids, param)))
    }
}
