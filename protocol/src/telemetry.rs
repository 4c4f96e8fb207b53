//! The report an agent pushes to every gateway about its replica (`POST /agent/report` on the
//! gateway's admin listener, `Authorization: Bearer TOKEN`), every 100 ms by default.

use crate::kv_events::{KvEventBatch, KvSnapshot};
use serde::{Deserialize, Serialize};

/// The report format this build speaks; a gateway rejects other versions with 400.
/// Version 2 added `kv` (KV-cache events), `gpus`, the gateway's [`ReportReply`] and, unsaid
/// for one gateway, `gateways`.
pub const TELEMETRY_VERSION: u32 = 2;

/// Where a report is posted, on the gateway's admin listener.
pub const REPORT_PATH: &str = "/agent/report";

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TelemetryReport {
    pub version: u32,
    /// The replica's name in the fleet (the agent's `--replica-id`, default its URL).
    pub replica: String,
    /// Where the gateway sends the replica's requests (`http://IP:PORT`).
    pub url: String,
    /// Changes whenever the worker process restarts: the gateway then forgets what it knew of
    /// the replica's cache.
    pub instance: u64,
    /// Counts up by one per report from this agent; a gateway that sees a gap knows it missed
    /// reports.
    pub seq: u64,
    /// The worker answers its health check (when not, `load` is all zeros).
    pub healthy: bool,
    pub load: EngineLoad,
    /// Changes to the worker's KV cache since the previous report, for engines whose KV events
    /// the agent reads (the kvgate worker); absent for the others (the gateway then routes
    /// them by its own approximate index).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv: Option<KvUpdate>,
    /// The agent's GPUs, read through NVML (empty without an NVIDIA driver).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpus: Vec<GpuStats>,
    /// How many gateways the agent reports to (its `--gateway` list), at most
    /// [`MAX_GATEWAYS`]: gateways that share no decisions each see only their part of the
    /// fleet's traffic, and scale what they count of it by this. Absent: one, or the agent
    /// does not say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateways: Option<u32>,
}

/// The most gateways a report may say its agent reports to.
pub const MAX_GATEWAYS: u32 = 1_024;

/// One GPU's figures at the moment of a report.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuStats {
    pub index: u32,
    pub name: String,
    pub memory_used_bytes: u64,
    pub memory_total_bytes: u64,
    /// Share of the last sample period in which a kernel ran.
    pub utilization_percent: u32,
    #[serde(default)]
    pub temperature_c: Option<u32>,
}

/// KV-cache state carried by a report: event batches in sequence, after a whole snapshot when
/// the agent (re)synchronises (first report, worker restart, lost events, or a gateway asked).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvUpdate {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<KvSnapshot>,
    #[serde(default)]
    pub batches: Vec<KvEventBatch>,
}

/// The gateway's answer to an accepted report.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReportReply {
    pub status: String,
    /// The gateway lost track of the replica's KV events (a gap, or it never had a snapshot):
    /// the next report should carry a snapshot.
    #[serde(default)]
    pub kv_snapshot: bool,
}

/// What an engine says about itself at one moment (an agent's adapters turn each engine's own
/// telemetry into this).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineLoad {
    pub models: Vec<String>,
    /// LoRA adapters loaded, and slots free for more (`None`: the engine does not say).
    #[serde(default)]
    pub adapters: Vec<String>,
    #[serde(default)]
    pub adapter_slots_free: Option<u32>,
    pub running: u32,
    pub waiting: u32,
    pub kv_blocks_total: u64,
    pub kv_blocks_used: u64,
    /// Tokens per KV block (0 when the engine does not say).
    pub block_size: u32,
    /// Speculative decoding's counters since the engine started, when it speculates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec: Option<SpecCounters>,
    /// What a block in the engine's host tier is worth against one on the device: the share
    /// of computing it that loading it back saves (1 - the load's measured cost), when the
    /// engine keeps such a tier and says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_block_value: Option<f64>,
    /// The same for a block in its disk tier.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_block_value: Option<f64>,
}

/// How an engine's speculative drafts fare (vLLM's `spec_decode` counters), cumulative.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SpecCounters {
    pub drafts: u64,
    pub draft_tokens: u64,
    pub accepted_tokens: u64,
}

impl SpecCounters {
    /// Drafted tokens kept, over drafted tokens (`None` before the first draft).
    pub fn acceptance_rate(&self) -> Option<f64> {
        (self.draft_tokens > 0).then(|| self.accepted_tokens as f64 / self.draft_tokens as f64)
    }
}

impl EngineLoad {
    /// Fraction of KV blocks in use (0 when the engine reports no blocks).
    pub fn kv_usage(&self) -> f64 {
        if self.kv_blocks_total == 0 {
            0.0
        } else {
            self.kv_blocks_used as f64 / self.kv_blocks_total as f64
        }
    }
}

/// Compares a presented bearer token with the expected one in time that does not depend on
/// where they differ (only on the presented length).
pub fn token_matches(presented: &[u8], expected: &[u8]) -> bool {
    let mut diff = u8::from(presented.len() != expected.len());
    for (i, &p) in presented.iter().enumerate() {
        diff |= p ^ expected.get(i).copied().unwrap_or(!p);
    }
    diff == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_match_only_when_equal() {
        assert!(token_matches(b"s3cret", b"s3cret"));
        assert!(!token_matches(b"s3cres", b"s3cret"));
        assert!(!token_matches(b"s3cre", b"s3cret"));
        assert!(!token_matches(b"s3cret!", b"s3cret"));
        assert!(!token_matches(b"", b"s3cret"));
        assert!(token_matches(b"", b""));
    }

    #[test]
    fn reports_round_trip_and_reject_unknown_fields() {
        let r = TelemetryReport {
            version: TELEMETRY_VERSION,
            replica: "gpu0".into(),
            url: "http://127.0.0.1:9001".into(),
            load: EngineLoad {
                kv_blocks_total: 100,
                kv_blocks_used: 25,
                ..Default::default()
            },
            ..Default::default()
        };
        let json = serde_json::to_string(&r).unwrap_or_default();
        assert_eq!(
            serde_json::from_str::<TelemetryReport>(&json).ok(),
            Some(r.clone())
        );
        // Unsaid, `gateways` is left out, so that a gateway of an earlier release takes it.
        assert!(!json.contains("gateways"), "{json}");
        let eight = TelemetryReport {
            gateways: Some(8),
            ..r.clone()
        };
        let json8 = serde_json::to_string(&eight).unwrap_or_default();
        assert_eq!(
            serde_json::from_str::<TelemetryReport>(&json8).ok(),
            Some(eight)
        );
        assert_eq!(r.load.kv_usage(), 0.25);
        let mut v: serde_json::Value = serde_json::from_str(&json).unwrap_or_default();
        v["surprise"] = 1.into();
        assert!(serde_json::from_value::<TelemetryReport>(v).is_err());
    }
}
