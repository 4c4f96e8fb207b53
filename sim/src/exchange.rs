//! The exchange between simulated gateways (`--gateway-exchange-ms`), as `peers:` runs it
//! between real ones: each kvgate decision reaches the other gateways after the delay, and a
//! gateway's prefill backlog reaches them within the delay of changing, repeated while it
//! stands so that it does not lapse.

use crate::gateway::Gateway;
use kvgate_policies::{RequestFeatures, PEER_BACKLOG_LAPSE_MS};
use std::collections::VecDeque;

pub(crate) struct Exchange {
    delay_us: u64,
    /// Decisions sent and not yet delivered, oldest first (every one takes the same delay):
    /// from, replica, the request's features.
    decisions: VecDeque<(usize, usize, RequestFeatures)>,
    /// When each gateway next tells the others its backlog, if it is due to.
    backlog_due_us: Vec<Option<u64>>,
}

impl Exchange {
    pub fn new(delay_ms: u64, gateways: usize) -> Self {
        Exchange {
            delay_us: delay_ms * 1_000,
            decisions: VecDeque::new(),
            backlog_due_us: vec![None; gateways],
        }
    }

    /// Gateway `from` sent a request to `replica`; returns when the others learn it.
    pub fn decided(
        &mut self,
        from: usize,
        replica: usize,
        features: RequestFeatures,
        now_us: u64,
    ) -> u64 {
        self.decisions.push_back((from, replica, features));
        now_us + self.delay_us
    }

    /// The oldest decision in flight reaches the other gateways.
    pub fn deliver_decision(&mut self, gateways: &mut [Gateway]) {
        let Some((from, replica, features)) = self.decisions.pop_front() else {
            return;
        };
        for (g, gateway) in gateways.iter_mut().enumerate() {
            if g != from {
                gateway.peer_sent(replica, &features);
            }
        }
    }

    /// Gateway `g`'s backlog changed: returns when it tells the others, unless it already
    /// will by then.
    pub fn backlog_changed(&mut self, g: usize, now_us: u64) -> Option<u64> {
        let at = now_us + self.delay_us;
        let due = &mut self.backlog_due_us[g];
        due.is_none_or(|d| d > at).then(|| *due.insert(at))
    }

    /// If gateway `g`'s backlog is due now, tells the others; returns when to repeat it.
    pub fn share_backlog(
        &mut self,
        g: usize,
        now_us: u64,
        gateways: &mut [Gateway],
    ) -> Option<u64> {
        if self.backlog_due_us[g] != Some(now_us) {
            return None;
        }
        self.backlog_due_us[g] = None;
        let backlog = gateways[g].fleet.backlogs();
        let expires_ms = now_us / 1_000 + PEER_BACKLOG_LAPSE_MS;
        for (other, gateway) in gateways.iter_mut().enumerate() {
            if other != g {
                gateway
                    .fleet
                    .peer_backlog(g as u64, backlog.clone(), expires_ms);
            }
        }
        if backlog.is_empty() {
            return None;
        }
        let at = now_us + PEER_BACKLOG_LAPSE_MS * 1_000 / 4;
        self.backlog_due_us[g] = Some(at);
        Some(at)
    }
}
