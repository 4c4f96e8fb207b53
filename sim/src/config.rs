//! A simulated fleet's settings, and the engine each of its replicas runs.

use kvgate_protocol::HashSeed;
use kvgate_worker::backend::profile::Profile;
use kvgate_worker::backend::sim::SimBackend;
use kvgate_worker::sched::SchedulerConfig;
use kvgate_worker::spec::SpecConfig;
use kvgate_worker::{Engine, EngineConfig};

#[derive(Debug, Clone)]
pub struct SimConfig {
    pub replicas: usize,
    pub gateways: usize,
    pub profile: Profile,
    /// KV blocks per replica; `None`: what the profile's memory holds.
    pub num_blocks: Option<usize>,
    pub block_size: usize,
    pub max_model_len: usize,
    /// How often each agent reports, and how long a report takes to reach the gateways.
    pub report_interval_ms: u64,
    pub report_delay_ms: u64,
    /// The served model's name (it seeds the block hashes).
    pub model: String,
    /// Seeds the open-loop start times, as `kvgate bench --seed` does.
    pub seed: u64,
    /// The first requests sent, marked warm-up (left out of the summary), as `kvgate bench
    /// --warmup` does.
    pub warmup: usize,
    /// Each modelled step takes this many times longer, as with `kvgate worker --time-scale`
    /// (to compare with a slowed real fleet: every time in the run, the gateways' clocks
    /// included, is then in its units).
    pub time_scale: f64,
    /// Time a request takes from its client through the gateway to its replica, outside the
    /// engines (a gateway's own latency, the network): in every TTFT and, in a closed loop,
    /// in every turn.
    pub gateway_delay_us: u64,
    /// Plus a uniform draw in `[0, gateway_jitter_us)` per request, from `jitter_seed`: the
    /// timing noise of real processes, so that seeds of it give a run's spread.
    pub gateway_jitter_us: u64,
    /// A turn's answer comes back in the next turn as the tokens the engine generated (true:
    /// a real model's text re-tokenizes to them), or as other tokens (false: the sim worker's
    /// random tokens do not survive detokenizing and tokenizing again, so only the previous
    /// prompt is reused).
    pub answers_round_trip: bool,
    pub jitter_seed: u64,
    /// Gateways tell each other where they sent each request (kvgate's decisions: the prefix
    /// and session each other gateway then assumes there), and their prefill backlogs as
    /// they change, after this long; `None`: they do not, each knowing only its own decisions
    /// and the agents' reports.
    pub exchange_delay_ms: Option<u64>,
    /// How often each replica's load and KV use is sampled for the timeline (0: never).
    pub sample_interval_ms: u64,
    /// Speculative decoding in every engine (`Method::Modelled` for a workload's acceptance).
    pub speculation: Option<SpecConfig>,
    /// Each engine's host offload tier in bytes (0: none), its copies priced by the
    /// profile's device-host link.
    pub offload_bytes: usize,
    /// Prefill/decode disaggregation: the first this many replicas prefill (`--role
    /// prefill`), the rest decode; 0: every replica serves requests whole.
    pub prefill_replicas: usize,
    /// With prefill replicas: prompts shorter than this go to a decode replica whole (the
    /// gateway pool's `min_prompt_tokens`).
    pub pd_min_prompt_tokens: usize,
}

/// A decode replica's host tier when none is given: pulled blocks land there (the sim's
/// blocks hold no bytes, so this only bounds the modelled sizes).
const DECODE_HOST_TIER_BYTES: usize = 64 << 30;

impl SimConfig {
    /// Checks that the replicas can be built (an engine whose KV pool holds less than one
    /// request of the context length cannot), before anything runs.
    pub fn check(&self) -> Result<(), String> {
        if self.prefill_replicas > 0 && self.prefill_replicas >= self.replicas {
            return Err(format!(
                "{} prefill replicas leave none of the {} to decode",
                self.prefill_replicas, self.replicas
            ));
        }
        self.engine(0).map(|_| ())?;
        self.engine(self.replicas - 1).map(|_| ())
    }

    /// Whether replica `i` prefills for others (see [`SimConfig::prefill_replicas`]).
    pub(crate) fn prefills(&self, i: usize) -> bool {
        i < self.prefill_replicas
    }

    /// Seconds a block takes between replicas in a hand-over: its modelled size over the
    /// profile's host link (the check refuses a run without one).
    pub(crate) fn hand_over_seconds_per_block(&self) -> f64 {
        let bytes = self.profile.model.kv_bytes_per_token * self.block_size as f64;
        self.profile
            .host_copy_seconds(bytes as usize)
            .unwrap_or(0.0)
    }

    /// What seeds the block hashes, in the engines and the gateways alike.
    pub(crate) fn hash_seed(&self) -> HashSeed {
        HashSeed::new(&self.model, None, "")
    }

    /// Every replica's scheduler settings (the worker's defaults).
    pub(crate) fn scheduler(&self) -> SchedulerConfig {
        SchedulerConfig::default()
    }

    /// Replica `i`'s engine (a decode replica has a host tier for the blocks it pulls).
    pub(crate) fn engine(&self, i: usize) -> Result<Engine<SimBackend>, String> {
        let engine_config = EngineConfig {
            block_size: self.block_size,
            num_blocks: self.num_blocks,
            max_model_len: self.max_model_len,
            prefix_caching: true,
            scheduler: self.scheduler(),
            hash_seed: self.hash_seed(),
            eos_token_ids: Vec::new(),
        };
        let backend = SimBackend::new(self.profile.clone(), 1_000, 49_152);
        let mut engine = Engine::new(engine_config, backend).map_err(|e| e.to_string())?;
        if let Some(spec) = &self.speculation {
            engine.enable_speculation(spec.clone())?;
        }
        let decodes = self.prefill_replicas > 0 && !self.prefills(i);
        let offload_bytes = match (self.offload_bytes, decodes) {
            (0, true) => DECODE_HOST_TIER_BYTES,
            (bytes, _) => bytes,
        };
        if offload_bytes > 0 {
            engine
                .enable_offload(offload_bytes)
                .map_err(|e| match decodes {
                    true => format!("decode replicas take blocks into a host tier: {e}"),
                    false => e,
                })?;
        }
        Ok(engine)
    }
}
