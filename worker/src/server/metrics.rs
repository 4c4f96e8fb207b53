//! The worker's Prometheus metrics: `kvgate_worker_*`, plus the `vllm:` names that existing
//! dashboards, routers and the agent's vLLM adapter scrape.

use crate::engine::EngineStats;
use prometheus::{
    Encoder, Gauge, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
    TextEncoder,
};

const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

pub struct Metrics {
    registry: Registry,
    running: Vec<IntGauge>,
    waiting: Vec<IntGauge>,
    kv_usage: Vec<Gauge>,
    kv_blocks_total: IntGauge,
    kv_blocks_used: IntGauge,
    prefix_hit_rate: Gauge,
    preemptions: Vec<IntCounter>,
    prompt_tokens: Vec<IntCounter>,
    cached_prompt_tokens: IntCounter,
    generation_tokens: Vec<IntCounter>,
    spec_drafts: Vec<IntCounter>,
    spec_draft_tokens: Vec<IntCounter>,
    spec_accepted_tokens: Vec<IntCounter>,
    spec_accepted_per_pos: Vec<IntCounterVec>,
    spec_mean_acceptance_length: Gauge,
    offload_blocks: IntGauge,
    offload_bytes: IntGauge,
    offloaded_blocks: IntCounter,
    offload_loaded_blocks: IntCounter,
    disk_blocks: IntGauge,
    disk_bytes: IntGauge,
    disk_stored_blocks: IntCounter,
    disk_loaded_blocks: IntCounter,
    disk_failed_reads: IntCounter,
    pub ttft: Vec<Histogram>,
    pub itl: Vec<Histogram>,
    pub e2e: Vec<Histogram>,
    pub requests: IntCounter,
    /// Blocks sent to decode workers (`sent`) and taken from prefill workers (`received`).
    pub transfer_blocks: IntCounterVec,
    /// Pulls that ended early, by reason; the blocks not taken are computed.
    pub transfer_failures: IntCounterVec,
    pub transfer_seconds: Histogram,
    /// Prompts' blocks a prefill worker keeps for pulls: transfers, and their bytes.
    pub transfers_waiting: IntGauge,
    pub transfers_waiting_bytes: IntGauge,
}

impl Metrics {
    pub fn new() -> prometheus::Result<Metrics> {
        let registry = Registry::new();
        let reg = |c: Box<dyn prometheus::core::Collector>| registry.register(c);
        let int_gauge = |name: &str, help: &str| -> prometheus::Result<IntGauge> {
            let g = IntGauge::new(name, help)?;
            reg(Box::new(g.clone()))?;
            Ok(g)
        };
        let gauge = |name: &str, help: &str| -> prometheus::Result<Gauge> {
            let g = Gauge::new(name, help)?;
            reg(Box::new(g.clone()))?;
            Ok(g)
        };
        let counter = |name: &str, help: &str| -> prometheus::Result<IntCounter> {
            let c = IntCounter::new(name, help)?;
            reg(Box::new(c.clone()))?;
            Ok(c)
        };
        let histogram = |name: &str, help: &str| -> prometheus::Result<Histogram> {
            let h = Histogram::with_opts(
                HistogramOpts::new(name, help).buckets(LATENCY_BUCKETS.to_vec()),
            )?;
            reg(Box::new(h.clone()))?;
            Ok(h)
        };
        let counter_vec = |name: &str, help: &str, label: &str| {
            let c = IntCounterVec::new(Opts::new(name, help), &[label])?;
            reg(Box::new(c.clone()))?;
            prometheus::Result::Ok(c)
        };
        let both_int = |k: &str, v: &str, help: &str| -> prometheus::Result<Vec<IntGauge>> {
            Ok(vec![int_gauge(k, help)?, int_gauge(v, help)?])
        };
        let both_counter = |k: &str, v: &str, help: &str| -> prometheus::Result<Vec<IntCounter>> {
            Ok(vec![counter(k, help)?, counter(v, help)?])
        };
        let both_per_pos =
            |k: &str, v: &str, help: &str| -> prometheus::Result<Vec<IntCounterVec>> {
                [k, v]
                    .iter()
                    .map(|name| {
                        let c = IntCounterVec::new(Opts::new(*name, help), &["position"])?;
                        reg(Box::new(c.clone()))?;
                        Ok(c)
                    })
                    .collect()
            };
        let both_hist = |k: &str, v: &str, help: &str| -> prometheus::Result<Vec<Histogram>> {
            Ok(vec![histogram(k, help)?, histogram(v, help)?])
        };
        Ok(Metrics {
            running: both_int(
                "kvgate_worker_requests_running",
                "vllm:num_requests_running",
                "Requests being computed",
            )?,
            waiting: both_int(
                "kvgate_worker_requests_waiting",
                "vllm:num_requests_waiting",
                "Requests queued",
            )?,
            kv_usage: vec![
                gauge(
                    "kvgate_worker_kv_usage_ratio",
                    "Fraction of KV blocks in use",
                )?,
                gauge(
                    "vllm:kv_cache_usage_perc",
                    "Fraction of KV blocks in use (1 = full)",
                )?,
                gauge(
                    "vllm:gpu_cache_usage_perc",
                    "Fraction of KV blocks in use (older name)",
                )?,
            ],
            kv_blocks_total: int_gauge("kvgate_worker_kv_blocks_total", "KV blocks in the pool")?,
            kv_blocks_used: int_gauge(
                "kvgate_worker_kv_blocks_used",
                "KV blocks held by requests",
            )?,
            prefix_hit_rate: gauge(
                "kvgate_worker_prefix_cache_hit_ratio",
                "Prompt tokens served from the prefix cache, over all prompt tokens",
            )?,
            preemptions: both_counter(
                "kvgate_worker_preemptions_total",
                "vllm:num_preemptions_total",
                "Requests preempted (recomputed later)",
            )?,
            prompt_tokens: both_counter(
                "kvgate_worker_prompt_tokens_total",
                "vllm:prompt_tokens_total",
                "Prompt tokens of admitted requests",
            )?,
            cached_prompt_tokens: counter(
                "kvgate_worker_cached_prompt_tokens_total",
                "Prompt tokens served from the prefix cache",
            )?,
            generation_tokens: both_counter(
                "kvgate_worker_generation_tokens_total",
                "vllm:generation_tokens_total",
                "Tokens generated",
            )?,
            spec_drafts: both_counter(
                "kvgate_worker_spec_decode_drafts_total",
                "vllm:spec_decode_num_drafts_total",
                "Speculative drafts verified (one per request per step that drafted)",
            )?,
            spec_draft_tokens: both_counter(
                "kvgate_worker_spec_decode_draft_tokens_total",
                "vllm:spec_decode_num_draft_tokens_total",
                "Drafted tokens verified",
            )?,
            spec_accepted_tokens: both_counter(
                "kvgate_worker_spec_decode_accepted_tokens_total",
                "vllm:spec_decode_num_accepted_tokens_total",
                "Drafted tokens accepted",
            )?,
            spec_accepted_per_pos: both_per_pos(
                "kvgate_worker_spec_decode_accepted_tokens_per_pos_total",
                "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                "Drafts whose token at this position (0 first) was accepted",
            )?,
            spec_mean_acceptance_length: gauge(
                "kvgate_worker_spec_decode_mean_acceptance_length",
                "Tokens per verified draft, the model's own included (1 + accepted / drafts)",
            )?,
            offload_blocks: int_gauge(
                "kvgate_worker_kv_offload_blocks",
                "KV blocks held in the host offload tier",
            )?,
            offload_bytes: int_gauge(
                "kvgate_worker_kv_offload_bytes",
                "Bytes of host memory the offload tier holds",
            )?,
            offloaded_blocks: counter(
                "kvgate_worker_kv_offloaded_blocks_total",
                "Cached KV blocks evicted from the pool into the offload tier",
            )?,
            offload_loaded_blocks: counter(
                "kvgate_worker_kv_offload_loaded_blocks_total",
                "KV blocks loaded back from the offload tier instead of computed again",
            )?,
            disk_blocks: int_gauge(
                "kvgate_worker_kv_disk_blocks",
                "KV blocks held in the disk tier",
            )?,
            disk_bytes: int_gauge(
                "kvgate_worker_kv_disk_bytes",
                "Bytes of block files the disk tier holds",
            )?,
            disk_stored_blocks: counter(
                "kvgate_worker_kv_disk_stored_blocks_total",
                "KV blocks the host tier evicted and the disk tier wrote",
            )?,
            disk_loaded_blocks: counter(
                "kvgate_worker_kv_disk_loaded_blocks_total",
                "KV blocks read back from the disk tier instead of computed again",
            )?,
            disk_failed_reads: counter(
                "kvgate_worker_kv_disk_failed_reads_total",
                "Block files that did not read back whole (dropped; their prefixes computed)",
            )?,
            ttft: both_hist(
                "kvgate_worker_time_to_first_token_seconds",
                "vllm:time_to_first_token_seconds",
                "Arrival to first token",
            )?,
            itl: both_hist(
                "kvgate_worker_inter_token_latency_seconds",
                "vllm:inter_token_latency_seconds",
                "Gap between consecutive tokens",
            )?,
            e2e: both_hist(
                "kvgate_worker_request_duration_seconds",
                "vllm:e2e_request_latency_seconds",
                "Arrival to last token",
            )?,
            requests: counter(
                "kvgate_worker_requests_total",
                "Generation requests accepted",
            )?,
            transfer_blocks: counter_vec(
                "kvgate_worker_kv_transfer_blocks_total",
                "KV blocks moved between prefill and decode workers",
                "direction",
            )?,
            transfer_failures: counter_vec(
                "kvgate_worker_kv_transfer_failures_total",
                "Block pulls that ended early (the rest of the prompt is computed here)",
                "reason",
            )?,
            transfer_seconds: histogram(
                "kvgate_worker_kv_transfer_seconds",
                "A decode worker's pull of a prompt's blocks, from connect to the last block",
            )?,
            transfers_waiting: int_gauge(
                "kvgate_worker_kv_transfers_waiting",
                "Prompts whose blocks a prefill worker keeps for their decode worker's pull",
            )?,
            transfers_waiting_bytes: int_gauge(
                "kvgate_worker_kv_transfers_waiting_bytes",
                "The bytes of those blocks",
            )?,
            registry,
        })
    }

    /// Updates the engine-side metrics from two consecutive stats snapshots.
    pub fn record_engine(&self, before: &EngineStats, now: &EngineStats) {
        let set_all = |gs: &[IntGauge], v: usize| gs.iter().for_each(|g| g.set(v as i64));
        set_all(&self.running, now.running);
        set_all(&self.waiting, now.waiting);
        let used = now.kv_blocks_total - now.kv_blocks_free;
        let usage = if now.kv_blocks_total == 0 {
            0.0
        } else {
            used as f64 / now.kv_blocks_total as f64
        };
        self.kv_usage.iter().for_each(|g| g.set(usage));
        self.kv_blocks_total.set(now.kv_blocks_total as i64);
        self.kv_blocks_used.set(used as i64);
        if now.prompt_tokens > 0 {
            self.prefix_hit_rate
                .set(now.cached_prompt_tokens as f64 / now.prompt_tokens as f64);
        }
        let add = |cs: &[IntCounter], a: u64, b: u64| {
            cs.iter().for_each(|c| c.inc_by(b.saturating_sub(a)))
        };
        add(&self.preemptions, before.preemptions, now.preemptions);
        add(&self.prompt_tokens, before.prompt_tokens, now.prompt_tokens);
        add(
            std::slice::from_ref(&self.cached_prompt_tokens),
            before.cached_prompt_tokens,
            now.cached_prompt_tokens,
        );
        add(
            &self.generation_tokens,
            before.generated_tokens,
            now.generated_tokens,
        );
        let (was, is) = (&before.offload, &now.offload);
        self.offload_blocks.set(is.blocks as i64);
        self.offload_bytes.set(is.bytes as i64);
        add(
            std::slice::from_ref(&self.offloaded_blocks),
            was.offloaded_blocks,
            is.offloaded_blocks,
        );
        add(
            std::slice::from_ref(&self.offload_loaded_blocks),
            was.loaded_blocks,
            is.loaded_blocks,
        );
        if let Some(is) = &is.disk {
            let was = was.disk.clone().unwrap_or_default();
            self.disk_blocks.set(is.blocks as i64);
            self.disk_bytes.set(is.bytes as i64);
            for (counter, a, b) in [
                (
                    &self.disk_stored_blocks,
                    was.stored_blocks,
                    is.stored_blocks,
                ),
                (
                    &self.disk_loaded_blocks,
                    was.loaded_blocks,
                    is.loaded_blocks,
                ),
                (&self.disk_failed_reads, was.failed_reads, is.failed_reads),
            ] {
                add(std::slice::from_ref(counter), a, b);
            }
        }
        let (was, is) = (&before.spec, &now.spec);
        if is.drafts == was.drafts {
            return;
        }
        add(&self.spec_drafts, was.drafts, is.drafts);
        add(&self.spec_draft_tokens, was.draft_tokens, is.draft_tokens);
        add(
            &self.spec_accepted_tokens,
            was.accepted_tokens,
            is.accepted_tokens,
        );
        for (position, (a, b)) in was
            .accepted_per_pos
            .iter()
            .zip(&is.accepted_per_pos)
            .enumerate()
        {
            if b > a {
                let label = position.to_string();
                for c in &self.spec_accepted_per_pos {
                    c.with_label_values(&[label.as_str()]).inc_by(b - a);
                }
            }
        }
        if let Some(mean) = is.mean_acceptance_length() {
            self.spec_mean_acceptance_length.set(mean);
        }
    }

    pub fn observe(histograms: &[Histogram], seconds: f64) {
        histograms.iter().for_each(|h| h.observe(seconds));
    }

    pub fn render(&self) -> Vec<u8> {
        let mut buf = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut buf) {
            tracing::error!(error = %e, "cannot encode metrics");
        }
        buf
    }
}
