//! Per-request records and the summary, with vLLM's metric definitions:
//! - TTFT: from sending the request to the first chunk with non-empty content;
//! - TPOT: (end-to-end − TTFT) / (output tokens − 1), per request with more than one token;
//! - ITL: every gap between consecutive content chunks, pooled over requests;
//! - end-to-end: from sending to the end of the response.
//!
//! Token counts come from the server's `usage`. Warm-up requests and failed ones are left out
//! of the latency figures; failures are counted.

use serde::Serialize;
use std::collections::BTreeMap;

pub const DEFINITIONS: &str = "TTFT = first chunk with content; TPOT = (e2e - TTFT) / (output tokens - 1); ITL = every gap between content chunks, pooled; e2e = send to end of response; token counts from the server's usage";

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RequestRecord {
    pub index: usize,
    pub warmup: bool,
    /// Seconds from the start of the run to sending.
    pub start_s: f64,
    pub status: u16,
    pub ttft_s: Option<f64>,
    pub e2e_s: f64,
    #[serde(skip)]
    pub itl_s: Vec<f64>,
    pub prompt_tokens: Option<u64>,
    pub output_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    pub replica: Option<String>,
    /// The workload's prefix group (system prompt, session, first trace block).
    pub group: Option<String>,
    /// Why the gateway chose the replica, when it said (`x-kvgate-route`).
    pub route: Option<String>,
    pub error: Option<String>,
}

impl RequestRecord {
    pub fn ok(&self) -> bool {
        self.status == 200 && self.error.is_none()
    }

    pub fn tpot_s(&self) -> Option<f64> {
        let n = self.output_tokens?;
        (n > 1).then(|| (self.e2e_s - self.ttft_s.unwrap_or(0.0)) / (n - 1) as f64)
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Stats {
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub count: usize,
}

impl Stats {
    /// Percentiles by linear interpolation between the nearest ranks (numpy's default).
    pub fn of(mut values: Vec<f64>) -> Stats {
        values.retain(|v| v.is_finite());
        if values.is_empty() {
            return Stats::default();
        }
        values.sort_by(f64::total_cmp);
        let pct = |p: f64| {
            let rank = p * (values.len() - 1) as f64;
            let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
            values[lo] + (values[hi] - values[lo]) * (rank - lo as f64)
        };
        Stats {
            mean: values.iter().sum::<f64>() / values.len() as f64,
            p50: pct(0.50),
            p90: pct(0.90),
            p99: pct(0.99),
            count: values.len(),
        }
    }
}

/// Service-level objectives for goodput: a request counts if it meets every one given.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Slo {
    pub ttft_s: Option<f64>,
    pub tpot_s: Option<f64>,
    pub e2e_s: Option<f64>,
}

impl Slo {
    pub fn met_by(&self, r: &RequestRecord) -> bool {
        let within =
            |limit: Option<f64>, v: Option<f64>| limit.is_none_or(|l| v.is_some_and(|v| v <= l));
        r.ok()
            && within(self.ttft_s, r.ttft_s)
            && within(self.tpot_s, r.tpot_s().or(Some(0.0)))
            && within(self.e2e_s, Some(r.e2e_s))
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    pub ttft_s: Stats,
    pub tpot_s: Stats,
    pub itl_s: Stats,
    pub e2e_s: Stats,
    pub requests: usize,
    pub failed: usize,
    pub warmup: usize,
    /// From the first measured request sent to the last one finished.
    pub duration_s: f64,
    pub requests_per_s: f64,
    pub output_tokens_per_s: f64,
    pub goodput_requests_per_s: Option<f64>,
    pub slo: Slo,
    pub prompt_tokens: u64,
    pub output_tokens: u64,
    pub cached_tokens: u64,
    pub cached_token_ratio: f64,
    /// The workload's ideal single-replica ratio, where it is known.
    pub ideal_cached_token_ratio: Option<f64>,
    pub requests_per_replica: BTreeMap<String, usize>,
    /// Most over fewest requests per replica (1 when one replica or none is named).
    pub replica_imbalance: f64,
    pub definitions: &'static str,
    pub labels: BTreeMap<String, String>,
}

pub fn summarize(
    records: &[RequestRecord],
    slo: Slo,
    ideal: Option<f64>,
    labels: BTreeMap<String, String>,
) -> Summary {
    let measured: Vec<&RequestRecord> = records.iter().filter(|r| !r.warmup).collect();
    let ok: Vec<&RequestRecord> = measured.iter().copied().filter(|r| r.ok()).collect();
    let start = measured
        .iter()
        .map(|r| r.start_s)
        .fold(f64::INFINITY, f64::min);
    let end = measured
        .iter()
        .map(|r| r.start_s + r.e2e_s)
        .fold(f64::NEG_INFINITY, f64::max);
    let duration = if end > start { end - start } else { 0.0 };
    let per_s = |n: f64| if duration > 0.0 { n / duration } else { 0.0 };
    let sum = |f: fn(&RequestRecord) -> Option<u64>| ok.iter().filter_map(|r| f(r)).sum::<u64>();
    let (prompt, output, cached) = (
        sum(|r| r.prompt_tokens),
        sum(|r| r.output_tokens),
        sum(|r| r.cached_tokens),
    );
    let mut per_replica: BTreeMap<String, usize> = BTreeMap::new();
    for r in &ok {
        if let Some(name) = &r.replica {
            *per_replica.entry(name.clone()).or_default() += 1;
        }
    }
    let most = per_replica.values().max().copied().unwrap_or(0);
    let fewest = per_replica.values().min().copied().unwrap_or(0);
    let any_slo = slo.ttft_s.is_some() || slo.tpot_s.is_some() || slo.e2e_s.is_some();
    Summary {
        ttft_s: Stats::of(ok.iter().filter_map(|r| r.ttft_s).collect()),
        tpot_s: Stats::of(ok.iter().filter_map(|r| r.tpot_s()).collect()),
        itl_s: Stats::of(ok.iter().flat_map(|r| r.itl_s.iter().copied()).collect()),
        e2e_s: Stats::of(ok.iter().map(|r| r.e2e_s).collect()),
        requests: ok.len(),
        failed: measured.len() - ok.len(),
        warmup: records.len() - measured.len(),
        duration_s: duration,
        requests_per_s: per_s(ok.len() as f64),
        output_tokens_per_s: per_s(output as f64),
        goodput_requests_per_s: any_slo
            .then(|| per_s(ok.iter().filter(|r| slo.met_by(r)).count() as f64)),
        slo,
        prompt_tokens: prompt,
        output_tokens: output,
        cached_tokens: cached,
        cached_token_ratio: if prompt == 0 {
            0.0
        } else {
            cached as f64 / prompt as f64
        },
        ideal_cached_token_ratio: ideal,
        replica_imbalance: if fewest == 0 {
            1.0
        } else {
            most as f64 / fewest as f64
        },
        requests_per_replica: per_replica,
        definitions: DEFINITIONS,
        labels,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate_like_numpy() {
        let s = Stats::of((1..=10).map(f64::from).collect());
        assert_eq!((s.mean, s.p50, s.count), (5.5, 5.5, 10));
        assert!((s.p90 - 9.1).abs() < 1e-12 && (s.p99 - 9.91).abs() < 1e-12);
        assert_eq!(Stats::of(vec![]), Stats::default());
    }
}
