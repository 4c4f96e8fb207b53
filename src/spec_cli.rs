//! Speculative decoding's flags, shared by `kvgate worker` and `kvgate up` (which passes them
//! on to its workers unchanged).

use kvgate_worker::spec::{Method, NgramSettings, SpecConfig};
use std::num::NonZeroUsize;
use std::path::PathBuf;

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpecMethod {
    /// Prompt lookup in the request's own context (vLLM's `ngram`).
    Ngram,
    /// Prompt lookup, then a suffix cache of every request's prompt and output.
    Suffix,
    /// A smaller model with the target's vocabulary (`--spec-draft-model`).
    Draft,
    /// The sim backend's modelled drafts, kept at `--spec-acceptance` (fleet experiments).
    Sim,
}

#[derive(clap::Args, Clone, Debug)]
pub struct SpecArgs {
    /// Speculative decoding's drafter; without it, no speculation.
    #[arg(long, value_enum)]
    pub spec_method: Option<SpecMethod>,
    /// Most drafted tokens per request per step (1 to 16); each step verifies as many of them
    /// as the request's acceptance and the measured step costs make worthwhile.
    #[arg(long, default_value_t = 8)]
    pub spec_tokens: usize,
    /// Shortest n-gram prompt lookup matches (vLLM's `prompt_lookup_min`).
    #[arg(long, default_value_t = 2)]
    pub spec_ngram_min: usize,
    /// Longest n-gram prompt lookup tries first (vLLM's `prompt_lookup_max`).
    #[arg(long, default_value_t = 4)]
    pub spec_ngram_max: usize,
    /// The draft model for `--spec-method draft` (GGUF, the target's vocabulary).
    #[arg(long)]
    pub spec_draft_model: Option<PathBuf>,
    /// The draft model's KV cache, in MiB (requests that do not fit draft nothing; the least
    /// recently drafted give way first).
    #[arg(long, default_value_t = 256)]
    pub spec_draft_kv_mib: usize,
    /// The share of drafted tokens `--spec-method sim` gets right (0 to 1): what a workload's
    /// drafts would keep (measure it on a real worker's `/metrics`).
    #[arg(long)]
    pub spec_acceptance: Option<f64>,
    /// No drafts while more requests than this run (default: where the measured step costs
    /// say verification stops paying).
    #[arg(long)]
    pub spec_max_batch: Option<usize>,
    /// N-grams the suffix cache holds (about 100 bytes each), least recently used dropped.
    #[arg(long, default_value_t = 262_144)]
    pub spec_suffix_entries: usize,
}

impl SpecArgs {
    /// The configuration, or why it is wrong; `None` without `--spec-method`.
    pub fn config(&self) -> Result<Option<SpecConfig>, String> {
        if self.spec_draft_model.is_some() && self.spec_method != Some(SpecMethod::Draft) {
            return Err("--spec-draft-model needs --spec-method draft".into());
        }
        if self.spec_acceptance.is_some() && self.spec_method != Some(SpecMethod::Sim) {
            return Err("--spec-acceptance needs --spec-method sim".into());
        }
        let Some(method) = self.spec_method else {
            return Ok(None);
        };
        let ngram = NgramSettings::new(self.spec_ngram_min, self.spec_ngram_max)
            .map_err(|e| format!("--spec-ngram-min/--spec-ngram-max: {e}"))?;
        let method = match method {
            SpecMethod::Ngram => Method::Ngram,
            SpecMethod::Suffix => Method::Suffix {
                entries: NonZeroUsize::new(self.spec_suffix_entries)
                    .ok_or("--spec-suffix-entries must be at least 1")?,
            },
            SpecMethod::Draft => Method::Draft {
                model: self
                    .spec_draft_model
                    .clone()
                    .ok_or("--spec-method draft needs --spec-draft-model FILE.gguf")?,
                kv_cache_bytes: self
                    .spec_draft_kv_mib
                    .checked_mul(1 << 20)
                    .filter(|&b| b > 0)
                    .ok_or("--spec-draft-kv-mib must be at least 1")?,
            },
            SpecMethod::Sim => match self.spec_acceptance {
                Some(acceptance) if (0.0..=1.0).contains(&acceptance) => {
                    Method::Modelled { acceptance }
                }
                Some(bad) => {
                    return Err(format!(
                        "--spec-acceptance must be between 0 and 1, got {bad}"
                    ))
                }
                None => return Err("--spec-method sim needs --spec-acceptance F (0 to 1)".into()),
            },
        };
        if self.spec_max_batch == Some(0) {
            return Err(
                "--spec-max-batch must be at least 1 (leave --spec-method out for no speculation)"
                    .into(),
            );
        }
        SpecConfig::new(method, self.spec_tokens, ngram, self.spec_max_batch)
            .map(Some)
            .map_err(|e| format!("--spec-tokens: {e}"))
    }

    /// The same flags for a worker's command line.
    pub fn to_args(&self) -> Vec<String> {
        let Some(method) = self.spec_method else {
            return Vec::new();
        };
        let name = match method {
            SpecMethod::Ngram => "ngram",
            SpecMethod::Suffix => "suffix",
            SpecMethod::Draft => "draft",
            SpecMethod::Sim => "sim",
        };
        let mut args = vec![
            "--spec-method".to_string(),
            name.into(),
            "--spec-tokens".into(),
            self.spec_tokens.to_string(),
            "--spec-ngram-min".into(),
            self.spec_ngram_min.to_string(),
            "--spec-ngram-max".into(),
            self.spec_ngram_max.to_string(),
            "--spec-suffix-entries".into(),
            self.spec_suffix_entries.to_string(),
            "--spec-draft-kv-mib".into(),
            self.spec_draft_kv_mib.to_string(),
        ];
        if let Some(model) = &self.spec_draft_model {
            args.extend(["--spec-draft-model".into(), model.display().to_string()]);
        }
        if let Some(acceptance) = self.spec_acceptance {
            args.extend(["--spec-acceptance".into(), acceptance.to_string()]);
        }
        if let Some(max) = self.spec_max_batch {
            args.extend(["--spec-max-batch".into(), max.to_string()]);
        }
        args
    }
}
