//! Hardware/model profiles for the sim backend (`config/profiles/*.yaml`): the roofline
//! figures a step's duration is derived from. The only YAML reader in the worker.

use serde::{Deserialize, Serialize};
use std::path::Path;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    pub name: String,
    pub hardware: Hardware,
    pub model: ModelCost,
    pub efficiency: Efficiency,
    /// Fixed cost of one step (scheduling, kernel launches), in microseconds.
    pub step_overhead_us: f64,
    /// Fraction of device memory the engine may use (weights plus KV cache), as vLLM's
    /// `gpu_memory_utilization`.
    pub memory_utilization: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hardware {
    pub name: String,
    pub memory_bandwidth_gb_s: f64,
    /// Dense peak for the model's data type.
    pub peak_tflops: f64,
    pub memory_gib: f64,
    /// Device-host link bandwidth (PCIe, NVLink-C2C), GB/s one way: what an offload tier's
    /// copies cost. Absent: the profile models no offload tier.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_link_gb_s: Option<f64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelCost {
    pub name: String,
    pub parameters: f64,
    pub weight_bytes: f64,
    pub layers: u32,
    pub hidden_size: u32,
    /// K and V of every layer for one token.
    pub kv_bytes_per_token: f64,
}

/// Fractions of the peaks that real kernels reach.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Efficiency {
    pub bandwidth: f64,
    pub compute: f64,
}

impl Profile {
    pub fn load(path: &Path) -> Result<Profile, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let profile: Profile =
            serde_yaml_ng::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        profile
            .validate()
            .map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(profile)
    }

    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            (
                "hardware.memory_bandwidth_gb_s",
                self.hardware.memory_bandwidth_gb_s,
            ),
            ("hardware.peak_tflops", self.hardware.peak_tflops),
            ("hardware.memory_gib", self.hardware.memory_gib),
            ("model.parameters", self.model.parameters),
            ("model.weight_bytes", self.model.weight_bytes),
            ("model.kv_bytes_per_token", self.model.kv_bytes_per_token),
        ];
        let link = self
            .hardware
            .host_link_gb_s
            .map(|v| ("hardware.host_link_gb_s", v));
        for (name, v) in positive.into_iter().chain(link) {
            if !(v.is_finite() && v > 0.0) {
                return Err(format!("{name} must be a positive number, got {v}"));
            }
        }
        for (name, v) in [
            ("efficiency.bandwidth", self.efficiency.bandwidth),
            ("efficiency.compute", self.efficiency.compute),
            ("memory_utilization", self.memory_utilization),
        ] {
            if !(v > 0.0 && v <= 1.0) {
                return Err(format!("{name} must be in (0, 1], got {v}"));
            }
        }
        if self.kv_capacity_tokens() == 0 {
            return Err("the weights leave no memory for the KV cache".into());
        }
        Ok(())
    }

    /// Tokens of KV cache that fit beside the weights.
    pub fn kv_capacity_tokens(&self) -> usize {
        let usable = self.hardware.memory_gib * (1u64 << 30) as f64 * self.memory_utilization;
        ((usable - self.model.weight_bytes) / self.model.kv_bytes_per_token).max(0.0) as usize
    }

    /// Effective bytes per second and FLOP per second.
    fn rates(&self) -> (f64, f64) {
        (
            self.hardware.memory_bandwidth_gb_s * 1e9 * self.efficiency.bandwidth,
            self.hardware.peak_tflops * 1e12 * self.efficiency.compute,
        )
    }

    /// Seconds for one step computing, per request, `len` tokens after `start` earlier ones:
    /// the slower of reading the weights plus the attended KV and doing the FLOPs (dense
    /// layers, 2 per parameter per token, plus attention), plus the fixed step overhead.
    pub fn step_seconds(&self, slices: impl Iterator<Item = (usize, usize)>) -> f64 {
        let m = &self.model;
        let (mut bytes, mut flops) = (m.weight_bytes, 0.0);
        for (start, len) in slices {
            let (start, len) = (start as f64, len as f64);
            bytes += (start + len) * m.kv_bytes_per_token;
            flops += 2.0 * m.parameters * len;
            // QK^T and AV: 2 multiply-adds per layer, hidden dim and attended position.
            flops += 4.0
                * f64::from(m.layers)
                * f64::from(m.hidden_size)
                * len
                * (start + (len + 1.0) / 2.0);
        }
        let (bandwidth, compute) = self.rates();
        (bytes / bandwidth).max(flops / compute) + self.step_overhead_us * 1e-6
    }

    /// Seconds under which no schedule computes tokens `start..start + len` of one request at
    /// most `budget` a step, whatever shares its steps. It takes at least `len / budget` steps
    /// (rounded up), each paying its overhead and reading the weights and the KV up to its
    /// last token, which in the j-th step from the end is at least `start + len - j * budget`;
    /// the FLOPs add up the same however the tokens are split; and a step takes the slower of
    /// its bytes and its FLOPs, so the steps together take at least the slower of their sums.
    /// In one step, that step's time alone.
    pub fn prefill_floor_seconds(&self, start: usize, len: usize, budget: usize) -> f64 {
        let steps = len.div_ceil(budget.max(1));
        if steps <= 1 {
            return self.step_seconds(std::iter::once((start, len)));
        }
        let m = &self.model;
        let (start, len, budget, steps) = (start as f64, len as f64, budget as f64, steps as f64);
        let kv_read = steps * (start + len) - budget * steps * (steps - 1.0) / 2.0;
        let bytes = steps * m.weight_bytes + kv_read * m.kv_bytes_per_token;
        let flops = 2.0 * m.parameters * len
            + 4.0
                * f64::from(m.layers)
                * f64::from(m.hidden_size)
                * len
                * (start + (len + 1.0) / 2.0);
        let (bandwidth, compute) = self.rates();
        (bytes / bandwidth).max(flops / compute) + steps * self.step_overhead_us * 1e-6
    }

    /// Seconds to copy `bytes` over the device-host link (`None` without one).
    pub fn host_copy_seconds(&self, bytes: usize) -> Option<f64> {
        let link = self.hardware.host_link_gb_s?;
        Some(bytes as f64 / (link * 1e9))
    }

    /// The roofline's decode rate at batch 1 with `context` tokens: tokens per second.
    pub fn decode_tokens_per_second(&self, context: usize) -> f64 {
        1.0 / self.step_seconds(std::iter::once((context, 1)))
    }
}
