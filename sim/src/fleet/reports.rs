//! What the gateways learn besides their own decisions: the agents' reports, each delivered
//! to every gateway after the report delay, and, with the exchange on, the other gateways'
//! decisions and backlogs.

use super::{Event, Sim};

impl Sim<'_> {
    /// With the exchange on, gateway `g`'s last decision goes to the others.
    pub(super) fn share_decision(&mut self, g: usize) {
        if let (Some(x), Some((to, features))) =
            (&mut self.exchange, self.gateways[g].outbox.take())
        {
            let at = x.decided(g, to, features, self.now_us);
            self.push(at, Event::Exchange);
        }
    }

    /// The replica's agent reports (its load and KV events), to arrive after the delay.
    pub(super) fn report(&mut self, replica: usize) {
        let (mut report, update) =
            self.replicas[replica].report(&self.config.model, self.config.block_size);
        // Its agent reports to every gateway, and says how many there are.
        report.gateways = (self.config.gateways > 1).then_some(self.config.gateways as u32);
        self.reports_in_flight.push_back((replica, report, update));
        let at = self.now_us + self.config.report_delay_ms * 1_000;
        self.push(at, Event::Deliver);
    }

    /// The oldest report in flight reaches every gateway.
    pub(super) fn deliver(&mut self) {
        let Some((replica, report, update)) = self.reports_in_flight.pop_front() else {
            return;
        };
        let now_ms = self.now_us / 1_000;
        for gateway in &mut self.gateways {
            if gateway.report(replica, &report, &update, now_ms) {
                self.replicas[replica].needs_snapshot = true;
            }
        }
    }

    /// Gateway `g`'s backlog changed: with the exchange on, it tells the others within the
    /// exchange's delay (the push interval of a real gateway).
    pub(super) fn backlog_changed(&mut self, g: usize) {
        let now = self.now_us;
        if let Some(at) = self
            .exchange
            .as_mut()
            .and_then(|x| x.backlog_changed(g, now))
        {
            self.push(at, Event::Backlog { gateway: g });
        }
    }
}
