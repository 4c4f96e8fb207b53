//! The chat template from `tokenizer.chat_template`, rendered with minijinja as Python's jinja2
//! renders it for Hugging Face and vLLM (`trim_blocks`, `lstrip_blocks`, `raise_exception`).
//! Like them, and like llama-cpp-python's Jinja formatter, it injects whatever default system
//! prompt the template itself adds; llama.cpp's built-in C ChatML function does not.

use minijinja::{Environment, ErrorKind, Value};
use serde::Serialize;

#[derive(Debug, Clone, Serialize)]
pub struct TemplateMessage {
    pub role: String,
    pub content: String,
}

pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    pub fn new(
        source: String,
        bos_token: String,
        eos_token: String,
    ) -> Result<ChatTemplate, String> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| e.to_string())?;
        env.set_syntax(syntax);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<Value, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_template_owned("chat", source)
            .map_err(|e| format!("chat template does not parse: {e}"))?;
        Ok(ChatTemplate {
            env,
            bos_token,
            eos_token,
        })
    }

    /// The prompt text for `messages`, ending with the assistant's turn opener.
    pub fn render(&self, messages: &[TemplateMessage]) -> Result<String, String> {
        let template = self.env.get_template("chat").map_err(|e| e.to_string())?;
        template
            .render(minijinja::context! {
                messages => Value::from(minijinja::value::Serde(messages)),
                add_generation_prompt => true,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
            })
            .map_err(|e| format!("chat template: {e}"))
    }
}
