//! The `disaggregation:` section: pools of replicas by phase (prefill, decode) and the
//! hand-over their engines speak.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DisaggregationConfig {
    /// The first pool whose `models` include a request's model serves it.
    pub pools: Vec<PdPool>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PdPool {
    /// Models the pool serves (empty: every model).
    #[serde(default)]
    pub models: Vec<String>,
    /// How prefill and decode replicas hand a prompt over.
    pub flow: PdFlow,
    /// Labels every prefill replica carries (a colocated replica may carry both sets).
    pub prefill: BTreeMap<String, String>,
    /// Labels every decode replica carries.
    pub decode: BTreeMap<String, String>,
    /// Prompts shorter than this (in the gateway's count of prompt tokens) skip the prefill
    /// leg: a decode replica serves them whole, where the transfer would cost more than it
    /// saves.
    #[serde(default)]
    pub min_prompt_tokens: u64,
    /// `sglang`: the prefill replicas' bootstrap port, where a replica has no
    /// `bootstrap_port` label (SGLang's default).
    #[serde(default = "default_bootstrap_port")]
    pub bootstrap_port: u16,
}

fn default_bootstrap_port() -> u16 {
    8998
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PdFlow {
    /// vLLM's (and kvgate's worker's): the prefill leg first (`max_tokens` 1,
    /// `kv_transfer_params` asking for remote decode), then the decode leg with the
    /// `kv_transfer_params` the prefill leg returned; the client gets the decode leg's answer.
    Vllm,
    /// SGLang's: the same request to a prefill and a decode replica at once, with
    /// `bootstrap_host`, `bootstrap_port` and a fresh `bootstrap_room`; the client gets the
    /// decode replica's answer.
    Sglang,
}

impl DisaggregationConfig {
    /// The pool serving `model`, if any.
    pub fn pool(&self, model: &str) -> Option<&PdPool> {
        self.pools
            .iter()
            .find(|p| p.models.is_empty() || p.models.iter().any(|m| m == model))
    }

    /// Every problem, as (path under `disaggregation`, message).
    pub fn validate(&self) -> Vec<(String, String)> {
        let mut problems = Vec::new();
        if self.pools.is_empty() {
            problems.push(("pools".into(), "at least one pool is required".into()));
        }
        for (i, pool) in self.pools.iter().enumerate() {
            let path = |field: &str| format!("pools[{i}].{field}");
            for (field, labels) in [("prefill", &pool.prefill), ("decode", &pool.decode)] {
                if labels.is_empty() {
                    problems.push((
                        path(field),
                        "name the labels its replicas carry (e.g. {role: prefill})".into(),
                    ));
                }
            }
            if !pool.prefill.is_empty() && pool.prefill == pool.decode {
                problems.push((
                    path("decode"),
                    "the decode labels must differ from the prefill labels".into(),
                ));
            }
        }
        problems
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(models: &[&str], prefill: &[(&str, &str)], decode: &[(&str, &str)]) -> PdPool {
        let labels = |l: &[(&str, &str)]| {
            l.iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        PdPool {
            models: models.iter().map(|m| m.to_string()).collect(),
            flow: PdFlow::Vllm,
            prefill: labels(prefill),
            decode: labels(decode),
            min_prompt_tokens: 0,
            bootstrap_port: default_bootstrap_port(),
        }
    }

    #[test]
    fn the_first_pool_naming_a_model_serves_it() {
        let config = DisaggregationConfig {
            pools: vec![
                pool(&["a"], &[("p", "1")], &[("d", "1")]),
                pool(&[], &[("p", "2")], &[("d", "2")]),
            ],
        };
        assert_eq!(config.pool("a"), Some(&config.pools[0]));
        assert_eq!(config.pool("b"), Some(&config.pools[1]));
        assert!(config.validate().is_empty());
    }

    #[test]
    fn pools_without_labels_or_with_one_set_for_both_phases_are_refused() {
        let none = DisaggregationConfig { pools: vec![] };
        assert_eq!(none.validate()[0].0, "pools");
        let config = DisaggregationConfig {
            pools: vec![
                pool(&[], &[], &[("d", "1")]),
                pool(&[], &[("x", "1")], &[("x", "1")]),
            ],
        };
        let paths: Vec<String> = config.validate().into_iter().map(|(p, _)| p).collect();
        assert_eq!(paths, ["pools[0].prefill", "pools[1].decode"]);
    }
}
