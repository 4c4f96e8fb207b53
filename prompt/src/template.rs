//! The chat template from `tokenizer.chat_template`, rendered with minijinja as Python's jinja2
//! renders it for Hugging Face and vLLM (`trim_blocks`, `lstrip_blocks`, `raise_exception`,
//! and the Python string and dict methods templates call, such as `content.strip()`,
//! `content.startswith(...)`, `content.split(...)` and `tool.items()`, from minijinja-contrib).
//! Like them, and like llama-cpp-python's Jinja formatter, it injects whatever default system
//! prompt the template itself adds; llama.cpp's built-in C ChatML function does not.

use crate::content_splice;
use minijinja::value::{Enumerator, Object};
use minijinja::{Environment, ErrorKind, Value};
use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

/// Why a conversation did not render.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RenderError {
    /// The template refused it: its `raise_exception`, or an operation jinja2 fails on too.
    Refused(String),
    /// The template calls a method, filter, test or function this renderer lacks (and jinja2,
    /// or the engine's own renderer, may have): no fault of the conversation.
    Unsupported(String),
}

impl fmt::Display for RenderError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RenderError::Refused(m) | RenderError::Unsupported(m) => f.write_str(m),
        }
    }
}

impl From<minijinja::Error> for RenderError {
    fn from(e: minijinja::Error) -> Self {
        let message = format!("chat template: {e}");
        match e.kind() {
            ErrorKind::UnknownMethod
            | ErrorKind::UnknownFilter
            | ErrorKind::UnknownTest
            | ErrorKind::UnknownFunction => RenderError::Unsupported(message),
            _ => RenderError::Refused(message),
        }
    }
}

#[derive(Debug, Clone)]
pub struct TemplateMessage {
    pub role: String,
    pub content: String,
}

/// A message as the template reads it (`message.role`, `message['content']`): its two strings
/// as they are, without a map built for each.
#[derive(Debug)]
struct MessageObject {
    role: Value,
    content: Value,
}

impl Object for MessageObject {
    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        match key.as_str()? {
            "role" => Some(self.role.clone()),
            "content" => Some(self.content.clone()),
            _ => None,
        }
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        Enumerator::Str(&["role", "content"])
    }
}

pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    /// The template uses content as opaque text: long contents are spliced in after the
    /// render (`content_splice`).
    splices: bool,
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
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<Value, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_template_owned("chat", source)
            .map_err(|e| format!("chat template does not parse: {e}"))?;
        let mut template = ChatTemplate {
            env,
            bos_token,
            eos_token,
            splices: false,
        };
        // Each probe renders alike both ways (or fails alike), and some render at all.
        let (mut alike, mut rendered) = (true, false);
        for conversation in content_splice::PROBES {
            let messages: Vec<(&str, Cow<'_, str>)> = conversation
                .iter()
                .map(|&(r, c)| (r, Cow::from(c)))
                .collect();
            let whole = template.render_values(messages.iter().cloned());
            rendered |= whole.is_ok();
            alike &= template.render_spliced(&messages) == whole;
        }
        template.splices = alike && rendered;
        Ok(template)
    }

    /// The prompt text for `messages`, ending with the assistant's turn opener.
    pub fn render(&self, messages: &[TemplateMessage]) -> Result<String, RenderError> {
        self.render_each(
            messages
                .iter()
                .map(|m| (m.role.as_str(), Cow::from(m.content.as_str()))),
        )
    }

    /// As [`ChatTemplate::render`], for messages given as (role, content).
    pub fn render_each<'a>(
        &self,
        messages: impl Iterator<Item = (&'a str, Cow<'a, str>)>,
    ) -> Result<String, RenderError> {
        if !self.splices {
            return self.render_values(messages);
        }
        let messages: Vec<(&str, Cow<'_, str>)> = messages.collect();
        let bytes: usize = messages.iter().map(|(_, c)| c.len()).sum();
        if bytes >= content_splice::SPLICE_FROM_BYTES {
            if let Ok(text) = self.render_spliced(&messages) {
                return Ok(text);
            }
        }
        self.render_values(messages.into_iter())
    }

    /// The render with placeholders for contents, the contents spliced in; an error where the
    /// placeholders did not come through whole.
    fn render_spliced(&self, messages: &[(&str, Cow<'_, str>)]) -> Result<String, RenderError> {
        let placeholders = messages
            .iter()
            .enumerate()
            .map(|(i, (role, _))| (*role, Cow::from(content_splice::placeholder(i))));
        let rendered = self.render_values(placeholders)?;
        let contents: Vec<&str> = messages.iter().map(|(_, c)| c.as_ref()).collect();
        content_splice::splice(&rendered, &contents).ok_or_else(|| {
            RenderError::Refused("chat template: a content placeholder was cut".into())
        })
    }

    fn render_values<'a>(
        &self,
        messages: impl Iterator<Item = (&'a str, Cow<'a, str>)>,
    ) -> Result<String, RenderError> {
        let messages: Value = messages
            .map(|(role, content)| {
                Value::from_object(MessageObject {
                    role: Value::from(role),
                    content: Value::from(content),
                })
            })
            .collect();
        let template = self.env.get_template("chat")?;
        Ok(template.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => true,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        })?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(role: &str, content: &str) -> TemplateMessage {
        TemplateMessage {
            role: role.into(),
            content: content.into(),
        }
    }

    #[test]
    fn a_message_reads_as_a_map_of_role_and_content() {
        // What chat templates do with a message, rendered as jinja2 renders it for a dict.
        let source = "{% for m in messages %}\
            {% if loop.first and m['role'] != 'system' %}[default]{% endif %}\
            <{{ m.role }}>{{ m['content'] | trim }}\
            {% if 'content' in m and 'tool_calls' not in m %}+{% endif %}\
            {% for k, v in m | items %}{{ k }}={{ v | length }};{% endfor %}\
            {{ m.name is defined }}\
            {% endfor %}\
            {% if add_generation_prompt %}<assistant>{% endif %}{{ messages | length }}";
        let template = ChatTemplate::new(source.into(), "<s>".into(), "</s>".into()).unwrap();
        let text = template
            .render(&[message("user", " hi "), message("assistant", "yo")])
            .unwrap();
        assert_eq!(
            text,
            "[default]<user>hi+role=4;content=4;False<assistant>yo+role=9;content=2;False<assistant>2"
        );
    }

    #[test]
    fn python_string_and_dict_methods_work_as_in_jinja2() {
        // As Qwen's and other templates call them; the expected text is jinja2's.
        let source = "{% for m in messages %}\
            {% set content = m.content.strip() %}\
            {% if content.startswith('<think>') %}{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}\
            [{{ m.role.upper() }}|{{ content }}|{{ content.endswith('?') }}]\
            {% for k, v in m.items() %}{{ k }};{% endfor %}\
            {% endfor %}";
        let template = ChatTemplate::new(source.into(), String::new(), String::new()).unwrap();
        let text = template
            .render(&[
                message("user", "  Why?  "),
                message("assistant", "<think>hmm</think>\nBecause."),
            ])
            .unwrap();
        assert_eq!(
            text,
            "[USER|Why?|True]role;content;[ASSISTANT|Because.|False]role;content;"
        );
    }

    #[test]
    fn a_method_or_filter_the_renderer_lacks_is_unsupported_not_refused() {
        for source in [
            "{{ messages[0].content.casefold() }}",
            "{{ messages[0].content | wordcount }}",
            "{{ strftime_now('%Y') }}",
        ] {
            let template = ChatTemplate::new(source.into(), String::new(), String::new()).unwrap();
            let err = template.render(&[message("user", "x")]).unwrap_err();
            assert!(
                matches!(err, RenderError::Unsupported(_)),
                "{source}: {err:?}"
            );
        }
    }

    /// ChatML as SmolLM2's template writes it: each turn joined with `+`.
    const CHATML: &str = "{% for message in messages %}\
        {{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}\
        {% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    fn whole(template: &ChatTemplate, messages: &[TemplateMessage]) -> String {
        let pairs = messages
            .iter()
            .map(|m| (m.role.as_str(), Cow::from(m.content.as_str())));
        template.render_values(pairs).unwrap()
    }

    #[test]
    fn a_template_that_joins_contents_has_them_spliced_in_and_renders_as_whole() {
        let template = ChatTemplate::new(CHATML.into(), String::new(), String::new()).unwrap();
        assert!(template.splices);
        let long = format!(" {}\n", "word ".repeat(2_000));
        let messages = [
            message("system", &long),
            message("user", " hi "),
            message("assistant", ""),
        ];
        let text = template.render(&messages).unwrap();
        assert_eq!(text, whole(&template, &messages));
        assert!(text.starts_with("<|im_start|>system\n word word"));
        assert!(text.ends_with("<|im_start|>user\n hi <|im_end|>\n<|im_start|>assistant\n<|im_end|>\n<|im_start|>assistant\n"));
    }

    #[test]
    fn a_template_that_reads_contents_renders_them_whole() {
        for source in [
            "{% for m in messages %}{{ m.content.strip() }}{% endfor %}",
            "{% for m in messages %}{% if m.content.startswith('<think>') %}T{% endif %}{{ m.content }}{% endfor %}",
            "{% for m in messages %}{% if '</think>' in m.content %}{{ m.content.split('</think>')[-1] }}{% else %}{{ m.content }}{% endif %}{% endfor %}",
            "{% for m in messages %}{{ m.content | length }}{{ m.content }}{% endfor %}",
            "{% for m in messages %}{{ m.content[:3] }}{% endfor %}",
            "{% for m in messages %}{{ m.content | upper }}{% endfor %}",
        ] {
            let template = ChatTemplate::new(source.into(), String::new(), String::new()).unwrap();
            assert!(!template.splices, "{source}");
            let long = format!("  <think>{}</think>tail  ", "x".repeat(2_000));
            let messages = [message("user", &long)];
            assert_eq!(template.render(&messages).unwrap(), whole(&template, &messages));
        }
    }

    #[test]
    fn a_content_that_holds_a_placeholder_renders_whole() {
        let template = ChatTemplate::new(CHATML.into(), String::new(), String::new()).unwrap();
        let odd = format!("{}{}", "x".repeat(2_000), content_splice::placeholder(0));
        let messages = [message("user", "first"), message("user", &odd)];
        let text = template.render(&messages).unwrap();
        assert_eq!(text, whole(&template, &messages));
        assert!(text.contains(&content_splice::placeholder(0)));
    }

    #[test]
    fn raise_exception_is_an_error_with_its_message() {
        let source = "{% if messages[0].role == 'tool' %}{{ raise_exception('no tool first') }}{% endif %}ok";
        let template = ChatTemplate::new(source.into(), String::new(), String::new()).unwrap();
        let err = template.render(&[message("tool", "x")]).unwrap_err();
        assert!(
            matches!(&err, RenderError::Refused(m) if m.contains("no tool first")),
            "{err}"
        );
        assert_eq!(template.render(&[message("user", "x")]).unwrap(), "ok");
    }
}
