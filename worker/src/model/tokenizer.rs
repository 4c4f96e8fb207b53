//! The tokenizer, built from GGUF metadata alone with the `tokenizers` crate: byte-level BPE
//! from the vocabulary and merges, the pre-tokenizer named by `tokenizer.ggml.pre`, control
//! tokens as special tokens. Token ids equal llama.cpp's (checked against golden ids recorded
//! from llama-cpp-python, `worker/tests/golden/`).

use super::gguf::{Gguf, GgufError, Value};
use std::collections::HashSet;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, PreTokenizerWrapper};

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
    /// Ids at or above this are placeholders for byte-level symbols the vocabulary lacks.
    vocab_size: u32,
    special_ids: HashSet<u32>,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
    /// Text of every token id, for stop-token and logprob output.
    tokens: Vec<String>,
}

impl Tokenizer {
    pub fn from_gguf(gguf: &Gguf) -> Result<Tokenizer, TokenizerError> {
        let model = gguf.get_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(TokenizerError::UnsupportedModel(model.to_string()));
        }
        let pre = gguf.get_str("tokenizer.ggml.pre").unwrap_or("gpt2");
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
            special_ids,
            bos_token_id: id("tokenizer.ggml.bos_token_id"),
            eos_token_id: id("tokenizer.ggml.eos_token_id"),
            tokens: tokens.iter().map(|s| s.to_string()).collect(),
        })
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
        let encoding = if parse_special {
            self.inner.encode_fast(text, false)
        } else {
            let mut plain = self.inner.clone();
            plain.set_encode_special_tokens(true);
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

/// The inverse of GPT-2's byte-to-symbol table: printable Latin-1 bytes stand for themselves,
/// the other 68 bytes were moved, in order, to U+0100 and up.
fn byte_of_symbol(c: char) -> Option<u8> {
    let printable = |b: u32| matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF);
    let code = c as u32;
    if code < 0x100 {
        return printable(code).then_some(code as u8);
    }
    let moved = code - 0x100;
    (0u32..0x100)
        .filter(|&b| !printable(b))
        .nth(moved as usize)
        .map(|b| b as u8)
}
