//! Reading an engine's telemetry: each engine exposes it differently, so an
//! [`EngineAdapter`] names the paths to fetch and turns their bodies into an [`EngineLoad`].
//! Parsing is pure (tested on recorded texts); fetching is the agent's.

pub use kvgate_protocol::telemetry::{EngineLoad, SpecCounters};
use kvgate_protocol::worker_stats::WorkerStats;
use std::collections::BTreeMap;

pub trait EngineAdapter: Send + Sync {
    /// Paths to fetch (relative to the engine's base URL), in the order `parse` takes them.
    fn paths(&self) -> &'static [&'static str];

    /// Builds a sample from the bodies of `paths` (`None` where a fetch failed).
    fn parse(&self, bodies: &[Option<String>]) -> Result<EngineLoad, String>;

    /// The engine publishes kvgate KV events (`/kv/events`, `/kv/snapshot`) for the agent to
    /// relay: only the kvgate worker does.
    fn relays_kv_events(&self) -> bool {
        false
    }
}

/// The adapter for an engine named on the command line.
pub fn for_engine(name: &str) -> Result<Box<dyn EngineAdapter>, String> {
    Ok(match name {
        "kvgate" => Box::new(Kvgate),
        "vllm" => Box::new(Vllm),
        "sglang" => Box::new(Sglang),
        "llamacpp" | "llama.cpp" => Box::new(LlamaCpp),
        other => {
            return Err(format!(
                "unknown engine `{other}` (known: kvgate, vllm, sglang, llamacpp)"
            ))
        }
    })
}

fn body<'a>(bodies: &'a [Option<String>], i: usize, path: &str) -> Result<&'a str, String> {
    bodies
        .get(i)
        .and_then(Option::as_deref)
        .ok_or_else(|| format!("no answer from {path}"))
}

fn json(text: &str, path: &str) -> Result<serde_json::Value, String> {
    serde_json::from_str(text).map_err(|e| format!("{path}: {e}"))
}

/// Model ids from an OpenAI `/v1/models` body (empty when absent or malformed).
fn model_ids(text: Option<&str>) -> Vec<String> {
    let Some(v) = text.and_then(|t| serde_json::from_str::<serde_json::Value>(t).ok()) else {
        return Vec::new();
    };
    v["data"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|m| m["id"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// The kvgate worker: `/stats`.
pub struct Kvgate;

impl EngineAdapter for Kvgate {
    fn paths(&self) -> &'static [&'static str] {
        &["/stats"]
    }

    fn relays_kv_events(&self) -> bool {
        true
    }

    fn parse(&self, bodies: &[Option<String>]) -> Result<EngineLoad, String> {
        let v: WorkerStats =
            serde_json::from_str(body(bodies, 0, "/stats")?).map_err(|e| format!("/stats: {e}"))?;
        let e = &v.engine;
        let count = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        Ok(EngineLoad {
            models: std::iter::once(v.model)
                .chain(v.adapters.iter().cloned())
                .collect(),
            adapter_slots_free: (v.max_loras > 0).then(|| count(v.adapter_slots_free)),
            adapters: v.adapters,
            running: count(e.running),
            waiting: count(e.waiting),
            kv_blocks_total: e.kv_blocks_total as u64,
            kv_blocks_used: e.kv_blocks_total.saturating_sub(e.kv_blocks_free) as u64,
            block_size: count(e.block_size),
            spec: (e.spec.drafts > 0).then_some(SpecCounters {
                drafts: e.spec.drafts,
                draft_tokens: e.spec.draft_tokens,
                accepted_tokens: e.spec.accepted_tokens,
            }),
            host_block_value: e.offload.load_cost.map(saved_by_loading),
            disk_block_value: e
                .offload
                .disk
                .as_ref()
                .map(|d| saved_by_loading(d.load_cost)),
        })
    }
}

/// vLLM: `/metrics` (Prometheus) and `/v1/models`.
pub struct Vllm;

impl EngineAdapter for Vllm {
    fn paths(&self) -> &'static [&'static str] {
        &["/metrics", "/v1/models"]
    }

    fn parse(&self, bodies: &[Option<String>]) -> Result<EngineLoad, String> {
        let m = Metrics::parse(body(bodies, 0, "/metrics")?);
        let usage = m
            .value("vllm:kv_cache_usage_perc")
            .or_else(|| m.value("vllm:gpu_cache_usage_perc"))
            .ok_or("/metrics: no vllm:kv_cache_usage_perc (nor the older gpu_cache_usage_perc)")?;
        let cache = m.labels("vllm:cache_config_info");
        let label = |labels: Option<&BTreeMap<String, String>>, key: &str| -> Option<u64> {
            labels?.get(key)?.parse().ok()
        };
        let total = label(cache, "num_gpu_blocks").unwrap_or(0);
        let lora = m.labels("vllm:lora_requests_info");
        let adapters: Vec<String> = lora
            .and_then(|l| l.get("running_lora_adapters"))
            .map(|s| {
                s.split(',')
                    .filter(|a| !a.is_empty())
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default();
        let slots_free =
            label(lora, "max_lora").map(|max| (max as u32).saturating_sub(adapters.len() as u32));
        Ok(EngineLoad {
            models: model_ids(bodies.get(1).and_then(Option::as_deref)),
            adapter_slots_free: slots_free,
            adapters,
            running: m.value("vllm:num_requests_running").unwrap_or(0.0) as u32,
            waiting: m.value("vllm:num_requests_waiting").unwrap_or(0.0) as u32,
            kv_blocks_total: total,
            kv_blocks_used: (usage * total as f64).round() as u64,
            block_size: label(cache, "block_size").unwrap_or(0) as u32,
            spec: m
                .value("vllm:spec_decode_num_drafts_total")
                .map(|drafts| SpecCounters {
                    drafts: drafts as u64,
                    draft_tokens: m
                        .value("vllm:spec_decode_num_draft_tokens_total")
                        .unwrap_or(0.0) as u64,
                    accepted_tokens: m
                        .value("vllm:spec_decode_num_accepted_tokens_total")
                        .unwrap_or(0.0) as u64,
                }),
            host_block_value: None,
            disk_block_value: None,
        })
    }
}

/// SGLang: `/metrics` (Prometheus, token-granular KV) and `/v1/models`.
pub struct Sglang;

impl EngineAdapter for Sglang {
    fn paths(&self) -> &'static [&'static str] {
        &["/metrics", "/v1/models"]
    }

    fn parse(&self, bodies: &[Option<String>]) -> Result<EngineLoad, String> {
        let m = Metrics::parse(body(bodies, 0, "/metrics")?);
        let running = m
            .value("sglang:num_running_reqs")
            .ok_or("/metrics: no sglang:num_running_reqs")?;
        let total = m.value("sglang:max_total_num_tokens").unwrap_or(0.0);
        let used = m
            .value("sglang:num_used_tokens")
            .or_else(|| m.value("sglang:token_usage").map(|u| u * total))
            .unwrap_or(0.0);
        Ok(EngineLoad {
            models: model_ids(bodies.get(1).and_then(Option::as_deref)),
            running: running as u32,
            waiting: m.value("sglang:num_queue_reqs").unwrap_or(0.0) as u32,
            kv_blocks_total: total as u64,
            kv_blocks_used: used.round() as u64,
            block_size: 1,
            ..EngineLoad::default()
        })
    }
}

/// llama.cpp's server: `/slots` (each slot's context and the tokens it caches), `/metrics`
/// when started with `--metrics` (deferred requests), `/v1/models`. KV is counted in tokens.
pub struct LlamaCpp;

impl EngineAdapter for LlamaCpp {
    fn paths(&self) -> &'static [&'static str] {
        &["/slots", "/metrics", "/v1/models"]
    }

    fn parse(&self, bodies: &[Option<String>]) -> Result<EngineLoad, String> {
        let slots = json(body(bodies, 0, "/slots")?, "/slots")?;
        let slots = slots.as_array().ok_or("/slots: not a list")?;
        let mut sample = EngineLoad {
            models: model_ids(bodies.get(2).and_then(Option::as_deref)),
            block_size: 1,
            ..EngineLoad::default()
        };
        for s in slots {
            sample.kv_blocks_total += s["n_ctx"].as_u64().unwrap_or(0);
            // The slot's cached tokens (its last prompt, which grows with what it generates).
            sample.kv_blocks_used += s["n_prompt_tokens"].as_u64().unwrap_or(0);
            sample.running += u32::from(s["is_processing"].as_bool() == Some(true));
        }
        if let Some(m) = bodies.get(1).and_then(Option::as_deref).map(Metrics::parse) {
            sample.waiting = m.value("llamacpp:requests_deferred").unwrap_or(0.0) as u32;
        }
        Ok(sample)
    }
}

/// Samples of a Prometheus text exposition: the first sample of each metric name.
#[derive(Debug, Default)]
pub struct Metrics {
    samples: BTreeMap<String, (BTreeMap<String, String>, f64)>,
}

impl Metrics {
    pub fn parse(text: &str) -> Metrics {
        let mut samples = BTreeMap::new();
        for line in text.lines().map(str::trim) {
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            if let Some((name, labels, value)) = parse_sample(line) {
                samples.entry(name).or_insert((labels, value));
            }
        }
        Metrics { samples }
    }

    pub fn value(&self, name: &str) -> Option<f64> {
        self.samples.get(name).map(|s| s.1)
    }

    pub fn labels(&self, name: &str) -> Option<&BTreeMap<String, String>> {
        self.samples.get(name).map(|s| &s.0)
    }
}

/// `name{k="v",...} value [timestamp]`.
fn parse_sample(line: &str) -> Option<(String, BTreeMap<String, String>, f64)> {
    let name_end = line.find(['{', ' ']).unwrap_or(line.len());
    let name = line[..name_end].to_string();
    let mut labels = BTreeMap::new();
    let mut rest = &line[name_end..];
    if let Some(inner) = rest.strip_prefix('{') {
        let mut chars = inner.char_indices();
        let mut key = String::new();
        loop {
            let (i, c) = chars.next()?;
            match c {
                '}' => {
                    rest = &inner[i + 1..];
                    break;
                }
                ',' | ' ' => {}
                '=' => {
                    chars.next().filter(|&(_, q)| q == '"')?;
                    let mut value = String::new();
                    loop {
                        match chars.next()?.1 {
                            '"' => break,
                            '\\' => match chars.next()?.1 {
                                'n' => value.push('\n'),
                                other => value.push(other),
                            },
                            other => value.push(other),
                        }
                    }
                    labels.insert(std::mem::take(&mut key), value);
                }
                other => key.push(other),
            }
        }
    }
    let value = rest.split_whitespace().next()?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    Some((name, labels, value))
}

/// A lower-tier block's worth against a device block: the share of computing it that loading
/// it back at `load_cost` saves.
fn saved_by_loading(load_cost: f64) -> f64 {
    (1.0 - load_cost).clamp(0.0, 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prometheus_samples_with_labels_escapes_and_timestamps() {
        let m = Metrics::parse(
            "# HELP x y\n# TYPE a gauge\na 1.5\nb{k=\"v, w\",q=\"a\\\"b\"} 2 1700000000\nc{} +Inf\nbad{k=\"v\" 1\n",
        );
        assert_eq!(m.value("a"), Some(1.5));
        assert_eq!(m.value("b"), Some(2.0));
        let labels = m.labels("b").cloned().unwrap_or_default();
        assert_eq!(labels.get("k").map(String::as_str), Some("v, w"));
        assert_eq!(labels.get("q").map(String::as_str), Some("a\"b"));
        assert_eq!(m.value("c"), Some(f64::INFINITY));
        assert_eq!(m.value("bad"), None);
    }

    #[test]
    fn unknown_engines_are_named() {
        assert!(for_engine("tgi").err().unwrap_or_default().contains("tgi"));
        assert!(for_engine("vllm").is_ok());
    }
}
