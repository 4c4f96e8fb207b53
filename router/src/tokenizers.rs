//! Token mode: for each model in `tokenizers:`, the prompt model (tokenizer and chat template)
//! that lets the gateway compute exactly the block hashes its workers report in KV events.
//! Loaded at start and on reload; an unchanged entry keeps its model and segment cache.

use crate::config::{ConfigError, GatewayConfig, TokenizerConfig};
use kvgate_prompt::PromptModel;
use kvgate_protocol::HashSeed;
use std::collections::BTreeMap;
use std::sync::Arc;

pub struct TokenMode {
    pub config: TokenizerConfig,
    pub prompt: PromptModel,
    /// The workers seed their block hashes with the served model name alone.
    pub seed: HashSeed,
    /// Prompts must leave room for one output token in this many tokens.
    pub context_length: usize,
}

/// Context length of a model whose config and file name none.
const DEFAULT_CONTEXT_LENGTH: usize = 131_072;

/// Token modes by model name.
pub type TokenModes = BTreeMap<String, Arc<TokenMode>>;

/// The token modes of `config`, reusing those of `old` whose settings are unchanged.
pub fn load(config: &GatewayConfig, old: &TokenModes) -> Result<TokenModes, Vec<ConfigError>> {
    let mut modes = TokenModes::new();
    let mut errors = Vec::new();
    for (i, t) in config.tokenizers.iter().enumerate() {
        if let Some(same) = old.get(&t.model).filter(|m| m.config == *t) {
            modes.insert(t.model.clone(), Arc::clone(same));
            continue;
        }
        match PromptModel::open(&t.path) {
            Ok(prompt) => {
                let context_length = t
                    .context_length
                    .or(prompt.context_length)
                    .unwrap_or(DEFAULT_CONTEXT_LENGTH);
                let mode = TokenMode {
                    config: t.clone(),
                    prompt,
                    seed: HashSeed::new(&t.model, None, ""),
                    context_length,
                };
                modes.insert(t.model.clone(), Arc::new(mode));
            }
            Err(e) => errors.push(ConfigError {
                path: format!("tokenizers[{i}].path"),
                line: None,
                message: format!("{}: {e}", t.path.display()),
            }),
        }
    }
    if errors.is_empty() {
        Ok(modes)
    } else {
        Err(errors)
    }
}
