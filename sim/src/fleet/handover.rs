//! Prefill/decode disaggregation in the fleet: a request's prefill leg, and its prompt's
//! blocks handed from the prefill replica to the decode replica.

use super::{Event, Sent, Sim};
use crate::gateway::Incoming;
use crate::routers::Turn;
use std::collections::BTreeMap;

/// Marks a prefill leg's id: request ids (a record's index, warm-up by it) stay the requests'.
const PREFILL_LEG: u64 = 1 << 63;
pub(super) const PREFILL: &str = "prefill";
pub(super) const DECODE: &str = "decode";

/// The labels of a disaggregated fleet's replicas of one phase (as a gateway's pool names
/// them).
pub(super) fn phase(name: &str) -> BTreeMap<String, String> {
    BTreeMap::from([("phase".to_string(), name.to_string())])
}

impl Sim<'_> {
    /// Request `id`'s prefill leg, as the gateway's pool sends it: the same prompt, one
    /// output token, to a prefill replica. Returns its id (the request's, marked).
    pub(super) fn prefill_leg(&mut self, id: u64, gateway: usize, turn: Turn) -> u64 {
        let leg = id | PREFILL_LEG;
        let decode = &self.sent[&id];
        let (job, prompt) = (decode.job, decode.prompt.clone());
        let incoming = Incoming {
            id: leg,
            turn,
            prompt: &prompt,
            job: &self.jobs[job],
            now_us: self.now_us,
        };
        let pool = phase(PREFILL);
        let replica =
            self.gateways[gateway].route(&incoming, &self.served, &|| Vec::new(), Some(&pool));
        self.backlog_changed(gateway);
        self.share_decision(gateway);
        let sent = Sent {
            hand_to: Some(id),
            ..Sent::new(job, gateway, replica, self.now_us, prompt, 1)
        };
        self.sent.insert(leg, sent);
        leg
    }

    /// A prefill leg ended: its prompt's blocks leave its replica for the decode leg's,
    /// arriving after their modelled transfer.
    pub(super) fn hand_over(&mut self, leg: Sent, to: u64) {
        let blocks = self.replicas[leg.replica].export_prompt(&leg.prompt);
        let transfer_s = blocks.len() as f64 * self.config.hand_over_seconds_per_block();
        let at = self.now_us + (transfer_s * self.config.time_scale * 1e6) as u64;
        self.handing_over.insert(to, blocks);
        self.push(at, Event::HandOver { id: to });
    }

    /// The blocks reach the decode replica's host tier; the decode leg starts there.
    pub(super) fn handed_over(&mut self, id: u64) -> Result<(), String> {
        let blocks = self.handing_over.remove(&id).unwrap_or_default();
        if let Some(sent) = self.sent.get(&id) {
            self.replicas[sent.replica].import_blocks(blocks)?;
        }
        self.arrive(id)
    }
}
