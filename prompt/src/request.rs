//! The rule that turns an OpenAI request into prompt token ids: chat messages rendered with
//! the chat template, text prompts tokenized with special-token text parsed, token prompts
//! taken as they are. The worker and the gateway both apply it, so their block hashes agree.

use crate::template::TemplateMessage;
use crate::PromptModel;
use kvgate_protocol::openai::{Endpoint, GenerationRequest, Prompt};
use kvgate_protocol::{ApiError, ErrorKind};

fn invalid(message: String, param: &str) -> ApiError {
    ApiError::new(ErrorKind::InvalidRequest, message).with_param(param)
}

impl PromptModel {
    /// The prompt's token ids, and the request field they came from (for errors about them).
    pub fn prompt_ids(
        &self,
        endpoint: Endpoint,
        r: &GenerationRequest,
    ) -> Result<(Vec<u32>, &'static str), ApiError> {
        let encode = |text: &str| {
            self.encode(text)
                .map_err(|e| ApiError::new(ErrorKind::Internal, e.to_string()))
        };
        let (ids, param) = match (endpoint, &r.messages, &r.prompt) {
            (Endpoint::Chat, Some(messages), _) => {
                let template = self.template.as_ref().ok_or_else(|| {
                    invalid(
                        "the model has no chat template; use /v1/completions".into(),
                        "messages",
                    )
                })?;
                let messages: Vec<TemplateMessage> = messages
                    .iter()
                    .map(|m| TemplateMessage {
                        role: m.role.clone(),
                        content: m.content.as_ref().map(|c| c.text()).unwrap_or_default(),
                    })
                    .collect();
                let text = template
                    .render(&messages)
                    .map_err(|e| invalid(e, "messages"))?;
                (encode(&text)?, "messages")
            }
            (_, _, Some(Prompt::Text(text))) => (encode(text)?, "prompt"),
            (_, _, Some(Prompt::Tokens(ids))) => {
                let vocab = self.tokenizer.vocab_size();
                if let Some(bad) = ids.iter().find(|&&t| t >= vocab) {
                    return Err(invalid(
                        format!("token id {bad} is outside the vocabulary (size {vocab})"),
                        "prompt",
                    ));
                }
                (ids.clone(), "prompt")
            }
            (_, _, Some(Prompt::Texts(v))) if v.len() == 1 => (encode(&v[0])?, "prompt"),
            (_, _, Some(Prompt::TokenLists(v))) if v.len() == 1 => (v[0].clone(), "prompt"),
            (_, _, Some(_)) => {
                return Err(invalid(
                    "batched prompts are not supported: send one prompt per request".into(),
                    "prompt",
                ))
            }
            _ => return Err(invalid("missing field `prompt`".into(), "prompt")),
        };
        if ids.is_empty() {
            return Err(invalid("the prompt is empty".into(), param));
        }
        Ok((ids, param))
    }
}
