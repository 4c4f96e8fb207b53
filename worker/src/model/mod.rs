//! The model file: GGUF metadata, the tokenizer and chat template built from it, and the
//! Llama hyperparameters.

mod cut;

pub use cut::{cut_layers, rewrite};
pub use kvgate_prompt::{gguf, template, tokenizer, PromptError, PromptModel};

use gguf::{Gguf, GgufError};
use std::path::Path;

/// Llama-family hyperparameters from `llama.*` metadata.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaParams {
    pub layers: usize,
    pub hidden: usize,
    pub ffn: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub context_length: usize,
    pub rope_theta: f32,
    pub rms_eps: f32,
    pub vocab_size: usize,
}

impl LlamaParams {
    pub fn from_gguf(g: &Gguf) -> Result<LlamaParams, GgufError> {
        let arch = g.get_str("general.architecture")?;
        let key = |k: &str| format!("{arch}.{k}");
        let int = |k: &str| g.get_u64(&key(k)).map(|v| v as usize);
        let heads = int("attention.head_count")?;
        let hidden = int("embedding_length")?;
        let vocab_size = match int("vocab_size") {
            Ok(v) => v,
            Err(_) => g.get_array("tokenizer.ggml.tokens")?.len(),
        };
        Ok(LlamaParams {
            layers: int("block_count")?,
            hidden,
            ffn: int("feed_forward_length")?,
            heads,
            kv_heads: int("attention.head_count_kv").unwrap_or(heads),
            head_dim: int("rope.dimension_count").unwrap_or(hidden / heads.max(1)),
            context_length: int("context_length")?,
            rope_theta: g.get_f64(&key("rope.freq_base")).unwrap_or(10_000.0) as f32,
            rms_eps: g
                .get_f64(&key("attention.layer_norm_rms_epsilon"))
                .unwrap_or(1e-5) as f32,
            vocab_size,
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Prompt(#[from] PromptError),
}

/// What the server needs from the model file whatever the backend: tokenizer and chat
/// template, hyperparameters.
pub struct ModelFile {
    pub gguf: Gguf,
    pub params: LlamaParams,
    pub prompt: PromptModel,
}

impl ModelFile {
    pub fn open(path: &Path) -> Result<ModelFile, ModelError> {
        let gguf = Gguf::open(path)?;
        let params = LlamaParams::from_gguf(&gguf)?;
        let prompt = PromptModel::from_gguf(&gguf)?;
        Ok(ModelFile {
            gguf,
            params,
            prompt,
        })
    }
}
