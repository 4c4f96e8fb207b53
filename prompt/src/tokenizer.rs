//! The tokenizer, built from GGUF metadata alone with the `tokenizers` crate: byte-level BPE
//! from the vocabulary and merges, the pre-tokenizer named by `tokenizer.ggml.pre`, control
//! tokens as special tokens. Token ids equal llama.cpp's (checked against golden ids recorded
//! from llama-cpp-python, `worker/tests/golden/`). A GGUF's byte-level BPE is pre-tokenized
//! directly (`byte_level.rs`), with only the BPE merges left to the crate.

use crate::added::{AddedTokens, Piece};
use crate::byte_level::{byte_of_symbol, ByteLevelWords};
use crate::gguf::{Gguf, GgufError, Value};
use crate::word_cache::WordCache;
use std::collections::HashSet;
use std::path::Path;
use std::sync::OnceLock;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::models::ModelWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, Model, PreTokenizerWrapper};

/// `tokenizer.ggml.token_type` of control tokens.
const CONTROL: u64 = 3;

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("tokenizer model `{0}` is not supported (only `gpt2` byte-level BPE is)")]
    UnsupportedModel(String),
    #[error("pre-tokenizer `{0}` is not supported (known: smollm, gpt2)")]
    UnsupportedPreTokenizer(String),
    #[error("tokenizer: {0}")]
    Build(String),
}

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// `inner` reading special-token text as plain text, made on first use (cloning it per
    /// call cost more than tokenizing).
    plain: OnceLock<tokenizers::Tokenizer>,
    /// Ids at or above this are placeholders for byte-level symbols the vocabulary lacks.
    vocab_size: u32,
    /// The added tokens, when all of them match their text verbatim.
    added: Option<AddedTokens>,
    /// The pre-tokenizer done directly, for a GGUF's byte-level BPE.
    words: Option<ByteLevelWords>,
    /// Ids of the words `words` cut that were tokenized before.
    word_ids: WordCache,
    special_ids: HashSet<u32>,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
    /// Text of every token id, for stop-token and logprob output.
    tokens: Vec<String>,
    /// The most bytes one token stands for: text longer than this many bytes a token cannot
    /// fit in fewer tokens.
    max_token_bytes: usize,
}

impl Tokenizer {
    pub fn from_gguf(gguf: &Gguf) -> Result<Tokenizer, TokenizerError> {
        let model = gguf.get_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(TokenizerError::UnsupportedModel(model.to_string()));
        }
        let pre = gguf.get_str("tokenizer.ggml.pre").unwrap_or("gpt2");
        let words = ByteLevelWords::new(pre == "smollm")
            .map_err(|e| TokenizerError::Build(e.to_string()))?;
        let pre_tokenizer: PreTokenizerWrapper = match pre {
            // Digits one by one, then the GPT-2 byte-level pattern without a prefix space.
            "smollm" => Sequence::new(vec![
                Digits::new(true).into(),
                ByteLevel::new(false, true, true).into(),
            ])
            .into(),
            "gpt2" | "default" => ByteLevel::new(false, true, true).into(),
            other => return Err(TokenizerError::UnsupportedPreTokenizer(other.to_string())),
        };
        let tokens = gguf.get_strings("tokenizer.ggml.tokens")?;
        let merges = gguf.get_strings("tokenizer.ggml.merges")?;
        let types: Vec<u64> = match gguf.get_array("tokenizer.ggml.token_type") {
            Ok(a) => a.iter().map(|v| v.as_u64().unwrap_or(1)).collect(),
            Err(_) => vec![1; tokens.len()],
        };
        let vocab_size = tokens.len() as u32;
        let mut vocab: Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.to_string(), i as u32))
            .collect();
        // Byte-level symbols missing from the vocabulary get placeholder ids past its end (and
        // are dropped after encoding), so that, as in llama.cpp, their neighbours do not merge
        // across them.
        let mut missing: Vec<char> = ByteLevel::alphabet()
            .into_iter()
            .filter(|c| !vocab.contains_key(&c.to_string()))
            .collect();
        missing.sort_unstable();
        for (k, c) in missing.into_iter().enumerate() {
            vocab.insert(c.to_string(), vocab_size + k as u32);
        }
        let merges: Vec<(String, String)> = merges
            .iter()
            .filter_map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
            })
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| TokenizerError::Build(e.to_string()))?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        inner.with_pre_tokenizer(Some(pre_tokenizer));
        inner.with_decoder(Some(ByteLevel::default()));
        let special: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|(_, &t)| t == CONTROL)
            .map(|(s, _)| AddedToken::from(s.to_string(), true))
            .collect();
        inner
            .add_special_tokens(special)
            .map_err(|e| TokenizerError::Build(e.to_string()))?;
        let special_ids = types
            .iter()
            .enumerate()
            .filter(|(_, &t)| t == CONTROL)
            .map(|(i, _)| i as u32)
            .collect();
        let id = |key: &str| gguf.get(key).ok().and_then(Value::as_u64).map(|v| v as u32);
        Ok(Tokenizer {
            inner,
            vocab_size,
            added: None,
            words: Some(words),
            word_ids: WordCache::new(),
            special_ids,
            bos_token_id: id("tokenizer.ggml.bos_token_id"),
            eos_token_id: id("tokenizer.ggml.eos_token_id"),
            tokens: tokens.iter().map(|s| s.to_string()).collect(),
            max_token_bytes: 0,
            plain: OnceLock::new(),
        }
        .completed())
    }

    /// With the fields derived from the model and its added tokens filled in.
    fn completed(mut self) -> Self {
        // Without the automaton (it cannot fail on a tokenizer's few texts) text is simply
        // not cut ahead of the crate's pipeline.
        self.added = self
            .verbatim_added_tokens()
            .and_then(|tokens| AddedTokens::new(tokens).ok());
        self.max_token_bytes = (0..self.vocab_size)
            .map(|id| self.token_bytes(id).len())
            .max()
            .unwrap_or(0)
            .max(1);
        self
    }

    /// The most bytes of text one token covers.
    pub fn max_token_bytes(&self) -> usize {
        self.max_token_bytes
    }

    /// A Hugging Face `tokenizer.json`, and what the `tokenizer_config.json` beside it says
    /// (nothing when there is none).
    pub fn from_json_file(path: &Path) -> Result<(Tokenizer, JsonConfig), TokenizerError> {
        let at =
            |e: &dyn std::fmt::Display| TokenizerError::Build(format!("{}: {e}", path.display()));
        let inner = tokenizers::Tokenizer::from_file(path).map_err(|e| at(&e))?;
        let vocab = inner.get_vocab(true);
        let vocab_size = vocab.values().max().map_or(0, |&m| m + 1);
        let mut tokens = vec![String::new(); vocab_size as usize];
        for (text, id) in vocab {
            tokens[id as usize] = text;
        }
        let special_ids = inner
            .get_added_tokens_decoder()
            .iter()
            .filter(|(_, t)| t.special)
            .map(|(&id, _)| id)
            .collect();
        let config = JsonConfig::beside(path)?;
        let id = |text: &str| {
            tokens
                .iter()
                .position(|t| !text.is_empty() && t == text)
                .map(|i| i as u32)
        };
        let tokenizer = Tokenizer {
            bos_token_id: id(&config.bos_token),
            eos_token_id: id(&config.eos_token),
            inner,
            vocab_size,
            added: None,
            words: None,
            word_ids: WordCache::new(),
            special_ids,
            tokens,
            max_token_bytes: 0,
            plain: OnceLock::new(),
        }
        .completed();
        Ok((tokenizer, config))
    }

    /// This tokenizer as a Hugging Face `tokenizer.json`.
    pub fn to_json(&self) -> Result<String, TokenizerError> {
        self.inner
            .to_string(false)
            .map_err(|e| TokenizerError::Build(e.to_string()))
    }

    /// The added tokens that split text before it is tokenized, when all of them match their
    /// text verbatim (`None` when some match otherwise, e.g. after normalisation or by
    /// stripping spaces: then text cannot be split ahead of the tokenizer).
    pub(crate) fn added_tokens(&self) -> Option<&AddedTokens> {
        self.added.as_ref()
    }

    fn verbatim_added_tokens(&self) -> Option<Vec<(String, u32)>> {
        self.inner
            .get_added_tokens_decoder()
            .iter()
            .map(|(&id, t)| {
                let verbatim = !(t.normalized || t.lstrip || t.rstrip || t.single_word);
                verbatim.then(|| (t.content.clone(), id))
            })
            .collect()
    }

    /// The text of an optional token (empty when absent), as chat templates take BOS and EOS.
    pub fn token_string(&self, id: Option<u32>) -> String {
        id.and_then(|i| self.token_text(i))
            .unwrap_or("")
            .to_string()
    }

    pub fn vocab_size(&self) -> u32 {
        self.vocab_size
    }

    /// The first id that is not a control token (the sim backend samples from here up).
    pub fn first_normal_token(&self) -> u32 {
        (0..self.vocab_size)
            .find(|id| !self.special_ids.contains(id))
            .unwrap_or(0)
    }

    pub fn is_special(&self, id: u32) -> bool {
        self.special_ids.contains(&id)
    }

    /// Token ids of `text`. With `parse_special`, control-token text such as `<|im_start|>`
    /// becomes its token (as in rendered chat prompts); without, it is plain text.
    pub fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>, TokenizerError> {
        if let (Some(words), ModelWrapper::BPE(bpe)) = (&self.words, self.inner.get_model()) {
            match (parse_special, &self.added) {
                (false, _) => return self.encode_byte_level(words, bpe, None, text),
                (true, Some(added)) => {
                    return self.encode_byte_level(words, bpe, Some(added), text)
                }
                // Added tokens that do not match verbatim: only the crate's pipeline cuts them.
                (true, None) => {}
            }
        }
        self.encode_reference(text, parse_special)
    }

    /// A byte-level BPE's ids, pre-tokenized directly; text is cut at `added` tokens first.
    fn encode_byte_level(
        &self,
        words: &ByteLevelWords,
        bpe: &BPE,
        added: Option<&AddedTokens>,
        text: &str,
    ) -> Result<Vec<u32>, TokenizerError> {
        let mut ids = Vec::with_capacity(text.len() / 3);
        let encode_text = |text: &str, ids: &mut Vec<u32>| {
            words.for_each(text, |word| -> Result<(), TokenizerError> {
                self.word_ids.extend(word, ids, |ids| {
                    let tokens = bpe
                        .tokenize(word)
                        .map_err(|e| TokenizerError::Build(e.to_string()))?;
                    // Placeholders for symbols the vocabulary lacks are dropped, as in
                    // `encode_reference`.
                    ids.extend(
                        tokens
                            .iter()
                            .map(|t| t.id)
                            .filter(|&id| id < self.vocab_size),
                    );
                    Ok(())
                })
            })
        };
        let Some(added) = added else {
            encode_text(text, &mut ids)?;
            return Ok(ids);
        };
        for piece in added.split(text) {
            match piece {
                Piece::Text(text) => encode_text(text, &mut ids)?,
                Piece::Token(id) => ids.push(id),
            }
        }
        Ok(ids)
    }

    /// [`Tokenizer::encode`] through the `tokenizers` crate's whole pipeline: the reference the
    /// direct byte-level path is checked against.
    pub fn encode_reference(
        &self,
        text: &str,
        parse_special: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        let encoding = if parse_special {
            self.inner.encode_fast(text, false)
        } else {
            let plain = self.plain.get_or_init(|| {
                let mut plain = self.inner.clone();
                plain.set_encode_special_tokens(true);
                plain
            });
            plain.encode_fast(text, false)
        }
        .map_err(|e| TokenizerError::Build(e.to_string()))?;
        Ok(encoding
            .get_ids()
            .iter()
            .copied()
            .filter(|&id| id < self.vocab_size)
            .collect())
    }

    /// Text of `ids`; control tokens are kept unless `skip_special`.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| TokenizerError::Build(e.to_string()))
    }

    /// The vocabulary entry of one token (byte-level symbols, as stored).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    /// The bytes one token stands for (for logprobs): control tokens are their own text,
    /// others map each byte-level symbol back to its byte.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let Some(text) = self.token_text(id) else {
            return Vec::new();
        };
        if self.is_special(id) {
            return text.as_bytes().to_vec();
        }
        let mut bytes = Vec::with_capacity(text.len());
        for c in text.chars() {
            match byte_of_symbol(c) {
                Some(b) => bytes.push(b),
                None => bytes.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
            }
        }
        bytes
    }
}

/// What a `tokenizer_config.json` says about chat prompts.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct JsonConfig {
    pub chat_template: Option<String>,
    pub bos_token: String,
    pub eos_token: String,
}

impl JsonConfig {
    /// Reads the `tokenizer_config.json` in the directory of `tokenizer_json`, if present.
    fn beside(tokenizer_json: &Path) -> Result<JsonConfig, TokenizerError> {
        let path = tokenizer_json.with_file_name("tokenizer_config.json");
        let Ok(text) = std::fs::read_to_string(&path) else {
            return Ok(JsonConfig::default());
        };
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| TokenizerError::Build(format!("{}: {e}", path.display())))?;
        // A token is a string or an object with its `content`.
        let token = |key: &str| {
            let t = &v[key];
            t.as_str()
                .or_else(|| t["content"].as_str())
                .unwrap_or("")
                .to_string()
        };
        // The template is a string, or a list of named ones of which `default` is used.
        let chat_template = match &v["chat_template"] {
            serde_json::Value::String(s) => Some(s.clone()),
            serde_json::Value::Array(named) => named
                .iter()
                .find(|t| t["name"] == "default")
                .and_then(|t| t["template"].as_str())
                .map(str::to_string),
            _ => None,
        };
        Ok(JsonConfig {
            chat_template,
            bos_token: token("bos_token"),
            eos_token: token("eos_token"),
        })
    }
}
