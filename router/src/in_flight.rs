//! A request's hold on its replica: counted in flight in the fleet state for the life of the
//! request, its prompt in the replica's prefill backlog until the first token; at the end, the
//! requests waiting for room are woken.

use kvgate_policies::{FleetState, RequestId};
use std::sync::{Arc, Mutex, PoisonError};

pub struct InFlight {
    fleet: Arc<Mutex<FleetState>>,
    released: Arc<tokio::sync::Notify>,
    pub id: RequestId,
    prefilled: bool,
}

impl InFlight {
    /// For request `id`, already sent in `fleet` ([`FleetState::send`]).
    pub fn new(
        fleet: Arc<Mutex<FleetState>>,
        released: Arc<tokio::sync::Notify>,
        id: RequestId,
    ) -> Self {
        InFlight {
            fleet,
            released,
            id,
            prefilled: false,
        }
    }

    /// The first token arrived (at `now_ms`, the gateway's clock): the prompt is no longer
    /// queued prefill.
    pub fn prefilled(&mut self, now_ms: u64) {
        if !std::mem::replace(&mut self.prefilled, true) {
            self.lock().first_token(self.id, now_ms);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, FleetState> {
        self.fleet.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.lock().finished(self.id);
        self.released.notify_waiters();
    }
}
