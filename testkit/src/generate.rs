//! Deterministic "generation": the answer is the prompt's last user text echoed word by word,
//! so a test knows the right content whichever worker served it.

pub use kvgate_protocol::openai::Endpoint;
use kvgate_protocol::openai::{ChatMessage, GenerationRequest, Prompt, Usage};
use kvgate_protocol::responses::{
    AssistantMessage, ChatChoice, ChatDelta, CompletionChoice, Responder,
};
use kvgate_protocol::ApiError;

/// One request's planned output.
#[derive(Debug, Clone)]
pub struct Job {
    pub responder: Responder,
    pub tokens: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    pub prompt_tokens: u32,
    pub finish_reason: &'static str,
}

/// Default output limit when the request sets none.
const DEFAULT_MAX_TOKENS: u32 = 16;

pub fn plan(endpoint: Endpoint, body: &[u8], id: String) -> Result<Job, ApiError> {
    let request = GenerationRequest::parse(endpoint, body)?;
    let (echoed, whole) = echoed_text(endpoint, &request);
    let max = request.max_output_tokens().unwrap_or(DEFAULT_MAX_TOKENS) as usize;
    let words: Vec<String> = echoed.split_inclusive(' ').map(str::to_string).collect();
    let finish_reason = if words.len() > max { "length" } else { "stop" };
    let mut tokens: Vec<String> = words.into_iter().take(max).collect();
    if tokens.is_empty() {
        tokens.push("ok".into());
    }
    Ok(Job {
        include_usage: request.include_usage(),
        responder: Responder::new(endpoint, id, request.model),
        tokens,
        stream: request.stream,
        prompt_tokens: whole.split_whitespace().count() as u32,
        finish_reason,
    })
}

/// The text the answer echoes (chat: the last user message; completions: the prompt), and
/// the whole prompt's text (its words are the prompt tokens).
fn echoed_text(endpoint: Endpoint, request: &GenerationRequest) -> (String, String) {
    let words = |ids: &mut dyn Iterator<Item = &u32>| {
        ids.map(|t| format!("t{t}")).collect::<Vec<_>>().join(" ")
    };
    match (endpoint, &request.messages, &request.prompt) {
        (Endpoint::Chat, Some(messages), _) => {
            let text = |m: &ChatMessage| {
                m.content
                    .as_ref()
                    .map(|c| c.text().into_owned())
                    .unwrap_or_default()
            };
            let last_user = messages
                .iter()
                .rev()
                .find(|m| m.role == "user")
                .map(text)
                .unwrap_or_default();
            (
                last_user,
                messages.iter().map(text).collect::<Vec<_>>().join(" "),
            )
        }
        (_, _, Some(prompt)) => {
            let text = match prompt {
                Prompt::Text(s) => s.clone(),
                Prompt::Texts(v) => v.join(" "),
                Prompt::Tokens(ids) => words(&mut ids.iter()),
                Prompt::TokenLists(lists) => words(&mut lists.iter().flatten()),
            };
            (text.clone(), text)
        }
        _ => (String::new(), String::new()),
    }
}

impl Job {
    fn usage(&self) -> Usage {
        Usage::new(self.prompt_tokens, self.tokens.len() as u32, 0)
    }

    /// A streamed chunk: a token, or (with `finish`) the closing chunk.
    pub fn chunk(&self, token: Option<&str>, finish: Option<&str>) -> String {
        match self.responder.endpoint {
            Endpoint::Chat => {
                let delta = ChatDelta {
                    role: token.map(|_| "assistant".into()),
                    content: token.map(str::to_string),
                };
                self.responder.chat_chunk(0, delta, None, finish)
            }
            Endpoint::Completions => self.responder.completion_chunk(CompletionChoice {
                index: 0,
                text: token.unwrap_or_default().to_string(),
                logprobs: None,
                finish_reason: finish.map(str::to_string),
            }),
        }
    }

    /// The usage chunk sent last when `stream_options.include_usage` is set.
    pub fn usage_chunk(&self) -> String {
        self.responder.usage_chunk(self.usage())
    }

    /// The whole non-streamed response.
    pub fn response(&self) -> Vec<u8> {
        let text = self.tokens.concat();
        let finish_reason = Some(self.finish_reason.into());
        match self.responder.endpoint {
            Endpoint::Chat => self.responder.chat_response(
                vec![ChatChoice {
                    index: 0,
                    message: AssistantMessage {
                        role: "assistant".into(),
                        content: text,
                    },
                    logprobs: None,
                    finish_reason,
                }],
                self.usage(),
            ),
            Endpoint::Completions => self.responder.completion_response(
                vec![CompletionChoice {
                    index: 0,
                    text,
                    logprobs: None,
                    finish_reason,
                }],
                self.usage(),
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn echoes_the_last_user_message_within_max_tokens() {
        let body = br#"{"model":"m","max_tokens":2,"messages":[{"role":"system","content":"be brief"},{"role":"user","content":"one two three"}]}"#;
        let job = plan(Endpoint::Chat, body, "x".into()).unwrap();
        assert_eq!(job.tokens, vec!["one ", "two "]);
        assert_eq!(job.finish_reason, "length");
        assert_eq!(job.prompt_tokens, 5);
        let job = plan(
            Endpoint::Completions,
            br#"{"model":"m","prompt":[1,2]}"#,
            "x".into(),
        )
        .unwrap();
        assert_eq!(job.tokens.concat(), "t1 t2");
        assert_eq!(job.finish_reason, "stop");
    }
}
