//! A request's hold on its replica: counted in flight in the fleet state for the life of the
//! request, its prompt in the replica's prefill backlog until the first token, its tokens the
//! ends of the replica's engine steps; at the end, the requests waiting for room are woken.

use kvgate_policies::{FleetState, RequestId, StepClock};
use std::sync::{Arc, Mutex, PoisonError};

pub struct InFlight {
    fleet: Arc<Mutex<FleetState>>,
    released: Arc<tokio::sync::Notify>,
    pub id: RequestId,
    prefilled: bool,
    steps: Option<Arc<StepClock>>,
    /// When its first and previous chunks arrived (µs): a step before the next.
    first_chunk_us: Option<u64>,
    last_chunk_us: Option<u64>,
}

impl InFlight {
    /// For request `id`, already sent in `fleet` ([`FleetState::send`]) to the replica whose
    /// engine steps `steps` keeps.
    pub fn new(
        fleet: Arc<Mutex<FleetState>>,
        released: Arc<tokio::sync::Notify>,
        id: RequestId,
        steps: Option<Arc<StepClock>>,
    ) -> Self {
        InFlight {
            fleet,
            released,
            id,
            prefilled: false,
            steps,
            first_chunk_us: None,
            last_chunk_us: None,
        }
    }

    /// A chunk of the answer arrived at `now_us`: its replica ended a step. No lock taken.
    pub fn token(&mut self, now_us: u64) {
        self.first_chunk_us.get_or_insert(now_us);
        if let Some(steps) = &self.steps {
            steps.token(now_us, self.last_chunk_us.replace(now_us));
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
        let mut fleet = self.lock();
        if let (Some(first), Some(last)) = (self.first_chunk_us, self.last_chunk_us) {
            fleet.streamed(self.id, first, last);
        }
        fleet.finished(self.id);
        drop(fleet);
        self.released.notify_waiters();
    }
}
