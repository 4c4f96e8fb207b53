//! A ranked replica and the figures behind its score.

use crate::{BySignal, ReplicaId};
use serde::Serialize;

/// One ranked replica and why it got its score.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Candidate {
    #[serde(skip)]
    pub replica: ReplicaId,
    pub total: f64,
    /// Each signal's value in [0, 1], before weighting.
    pub signals: BySignal,
    /// How far clockwise from the request's ring key the replica's first ring point lies
    /// (`u64::MAX` off the ring): the tie-breaker, so that every gateway replica breaks ties
    /// alike.
    pub ring_distance: u64,
    /// At or over its load cap or its agent's reported KV saturation (or a hard limit: the
    /// imbalance guard, its own `max_in_flight`, its queue limit): prefix and session
    /// stickiness are suspended (the prefill signal only at a hard limit).
    pub saturated: bool,
    /// Its bounded-load cap for this request: the decision's `load_bound`, raised by
    /// `cached_load_bonus` where it holds more of the prompt than the others.
    pub load_cap: u32,
    /// The leading prompt blocks (or text chunks) it holds, as the prefix index knows them;
    /// counted even when saturated.
    pub prefix_blocks: f64,
    /// The prompt tokens it would prefill (those it is not known to hold): what routing the
    /// request here adds to its prefill backlog.
    pub prefill_tokens: u64,
    /// The prefill queued ahead on it: this gateway's, less what the replica has likely
    /// computed of it, and what its peers said of theirs.
    pub prefill_backlog: u64,
    /// The rest of its engine's step under way, in the same tokens (counted in the prefill
    /// signal beside the backlog).
    pub step_wait: u64,
    /// Its wait for KV room, in the same tokens: where its engine queues requests for want of
    /// room, the running requests that must end before this one starts (counted in the
    /// prefill signal in place of the backlog and the step where longer).
    pub kv_wait: u64,
    pub in_flight: u32,
}

impl Candidate {
    /// The whole breakdown on one line, `name=value;…`: the total, every signal, then the
    /// figures behind them (the `x-kvgate-route` header).
    pub fn breakdown(&self) -> String {
        use std::fmt::Write;
        let mut out = format!("total={:.3}", self.total);
        for (signal, value) in self.signals.iter() {
            let _ = write!(out, ";{}={value:.3}", signal.name());
        }
        let _ = write!(
            out,
            ";ring_distance={};in_flight={};load_cap={};saturated={};prefix_blocks={};prefill_tokens={};prefill_backlog={};step_wait={};kv_wait={}",
            self.ring_distance,
            self.in_flight,
            self.load_cap,
            self.saturated,
            self.prefix_blocks,
            self.prefill_tokens,
            self.prefill_backlog,
            self.step_wait,
            self.kv_wait
        );
        out
    }
}
