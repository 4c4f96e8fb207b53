//! Prompts as token ids, the same way in every process: the GGUF reader, the tokenizer and
//! chat template built from a GGUF or a `tokenizer.json`, tokenization cached per segment
//! between special tokens, and the OpenAI request → prompt ids rule. The worker feeds these ids
//! to its engine; the gateway hashes them into the blocks the worker will report.

mod added;
mod byte_level;
mod content_splice;
pub mod gguf;
mod gguf_write;
mod request;
mod segments;
pub mod template;
pub mod tokenizer;
mod word_cache;

pub use request::RENDER_BYTES_PER_MESSAGE;

use gguf::{Gguf, GgufError};
use segments::SegmentCache;
use std::path::Path;
use template::ChatTemplate;
use tokenizer::{Tokenizer, TokenizerError};

#[derive(Debug, thiserror::Error)]
pub enum PromptError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error("{0}")]
    Template(String),
}

/// Tokens of the segment cache unless told otherwise: ~4 MB of ids.
pub const DEFAULT_CACHED_TOKENS: usize = 1 << 20;

/// A model's tokenizer and chat template, with a cache of tokenized segments.
pub struct PromptModel {
    pub tokenizer: Tokenizer,
    pub template: Option<ChatTemplate>,
    /// The model's context length in tokens, where its file says (GGUF metadata).
    pub context_length: Option<usize>,
    segments: SegmentCache,
}

impl PromptModel {
    pub fn new(tokenizer: Tokenizer, template: Option<ChatTemplate>) -> Self {
        let segments = SegmentCache::new(DEFAULT_CACHED_TOKENS);
        PromptModel {
            tokenizer,
            template,
            context_length: None,
            segments,
        }
    }

    pub fn from_gguf(gguf: &Gguf) -> Result<Self, PromptError> {
        let tokenizer = Tokenizer::from_gguf(gguf)?;
        let template = match gguf.get_str("tokenizer.chat_template") {
            Ok(source) => Some(
                ChatTemplate::new(
                    source.to_string(),
                    tokenizer.token_string(tokenizer.bos_token_id),
                    tokenizer.token_string(tokenizer.eos_token_id),
                )
                .map_err(PromptError::Template)?,
            ),
            Err(_) => None,
        };
        let context_length = gguf
            .get_str("general.architecture")
            .and_then(|arch| gguf.get_u64(&format!("{arch}.context_length")))
            .ok()
            .and_then(|n| usize::try_from(n).ok());
        Ok(PromptModel {
            context_length,
            ..PromptModel::new(tokenizer, template)
        })
    }

    /// From a GGUF file (metadata only is read), or a Hugging Face `tokenizer.json` (its chat
    /// template, BOS and EOS from the `tokenizer_config.json` beside it, where there is one).
    pub fn open(path: &Path) -> Result<Self, PromptError> {
        if path.extension().is_some_and(|e| e == "json") {
            let (tokenizer, config) = Tokenizer::from_json_file(path)?;
            let template = match config.chat_template {
                Some(source) => Some(
                    ChatTemplate::new(source, config.bos_token, config.eos_token)
                        .map_err(PromptError::Template)?,
                ),
                None => None,
            };
            return Ok(PromptModel::new(tokenizer, template));
        }
        PromptModel::from_gguf(&Gguf::open(path)?)
    }

    /// Token ids of `text` with special-token text parsed (as in rendered chat prompts), equal
    /// to [`Tokenizer::encode`]'s: the text between special tokens is tokenized on its own, so
    /// segments seen before (a system prompt, earlier turns) come from the cache.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        self.segments.encode(&self.tokenizer, text)
    }

    /// As [`PromptModel::encode`] while the text found in no cache comes to at most `budget`
    /// bytes (see [`SegmentCache::encode_within`]); `None` otherwise.
    pub fn encode_within(
        &self,
        text: &str,
        budget: &mut usize,
    ) -> Result<Option<Vec<u32>>, TokenizerError> {
        self.segments.encode_within(&self.tokenizer, text, budget)
    }
}
