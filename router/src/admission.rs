//! Admission by SLA class. While some replica of a request's pool has room (below its
//! in-flight cap, and below the KV and queue saturation its agent reports), requests pass at
//! once. Otherwise sheddable classes are refused (429, `Retry-After`) and the others wait in
//! per-class bounded queues with deadlines; as room appears, the waiting requests go in
//! priority order, first come first within a priority. A waiting request whose client leaves
//! leaves the queue.

use crate::classes::Class;
use kvgate_protocol::{ApiError, ErrorKind};
use std::cmp::Reverse;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// How often waiting requests look for room besides being woken by a finished request (room
/// also appears when an agent reports less load).
const POLL: Duration = Duration::from_millis(10);

#[derive(Default)]
pub struct Admission {
    waiting: Mutex<Waiting>,
    /// Woken when a request ends or one is admitted, so that the waiting ones look again.
    pub released: Arc<Notify>,
}

#[derive(Default)]
struct Waiting {
    entries: Vec<Entry>,
    next_seq: u64,
}

struct Entry {
    seq: u64,
    class: Arc<Class>,
    model: String,
}

/// Why a request was not admitted (for the metrics).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    Shed,
    QueueFull,
    Deadline,
}

impl Refused {
    pub fn label(self) -> &'static str {
        match self {
            Refused::Shed => "shed",
            Refused::QueueFull => "queue_full",
            Refused::Deadline => "deadline",
        }
    }
}

impl Admission {
    /// Admits a request of `class` for `model`: `take` (which routes it, counting it in
    /// flight) runs once `has_room(model, class)` holds and no request ahead of it in priority
    /// order could take that room. `on_depth` hears the class's queue depth as it changes.
    pub async fn admit<T>(
        &self,
        class: &Arc<Class>,
        model: &str,
        has_room: impl Fn(&str, &Class) -> bool,
        take: impl FnOnce() -> T,
        on_depth: impl Fn(usize),
    ) -> Result<T, (ApiError, Refused)> {
        let seq = {
            let mut w = self.waiting.lock().unwrap_or_else(PoisonError::into_inner);
            let ahead = w
                .entries
                .iter()
                .any(|e| e.class.priority >= class.priority && e.model == model);
            if !ahead && has_room(model, class) {
                return Ok(take());
            }
            if class.sheddable {
                let message = format!("the fleet is saturated and class `{}` is shed", class.name);
                return Err((
                    ApiError::new(ErrorKind::RateLimited, message),
                    Refused::Shed,
                ));
            }
            let depth = w
                .entries
                .iter()
                .filter(|e| e.class.name == class.name)
                .count();
            if depth >= class.max_queue {
                let message = format!(
                    "the queue of class `{}` is full ({} requests)",
                    class.name, class.max_queue
                );
                return Err((
                    ApiError::new(ErrorKind::RateLimited, message),
                    Refused::QueueFull,
                ));
            }
            let seq = w.next_seq;
            w.next_seq += 1;
            w.entries.push(Entry {
                seq,
                class: Arc::clone(class),
                model: model.to_string(),
            });
            on_depth(depth + 1);
            seq
        };
        let queued = Queued {
            admission: self,
            seq,
            class: &class.name,
            on_depth: &on_depth,
        };
        let deadline = Instant::now() + class.queue_timeout;
        loop {
            let released = self.released.notified();
            tokio::pin!(released);
            released.as_mut().enable();
            {
                let mut w = self.waiting.lock().unwrap_or_else(PoisonError::into_inner);
                let first = first_with_room(&w.entries, &has_room);
                if first == Some(seq) {
                    queued.leave(&mut w);
                    let taken = take();
                    drop(w);
                    // There may be room for the next one too.
                    self.released.notify_waiters();
                    return Ok(taken);
                }
            }
            if Instant::now() >= deadline {
                let message = format!(
                    "waited {} ms in the queue of class `{}` without room in the fleet",
                    class.queue_timeout.as_millis(),
                    class.name
                );
                return Err((
                    ApiError::new(ErrorKind::Unavailable, message),
                    Refused::Deadline,
                ));
            }
            tokio::select! {
                _ = released => {}
                _ = tokio::time::sleep(POLL) => {}
                _ = tokio::time::sleep_until(deadline.into()) => {}
            }
        }
    }
}

/// The entry to admit next: the first in (priority, arrival) order whose pool has room. Room
/// is checked once per (model, class), however many entries share them.
fn first_with_room(entries: &[Entry], has_room: &impl Fn(&str, &Class) -> bool) -> Option<u64> {
    let mut room: Vec<(&str, &str, bool)> = Vec::new();
    let mut best: Option<&Entry> = None;
    for e in entries {
        let known = room.iter().find(|m| m.0 == e.model && m.1 == e.class.name);
        let fits = match known {
            Some(&(_, _, r)) => r,
            None => {
                let r = has_room(&e.model, &e.class);
                room.push((&e.model, &e.class.name, r));
                r
            }
        };
        let key = |e: &Entry| (Reverse(e.class.priority), e.seq);
        if fits && best.is_none_or(|b| key(e) < key(b)) {
            best = Some(e);
        }
    }
    best.map(|e| e.seq)
}

/// A queue entry, removed when its request stops waiting for any reason (a client that
/// leaves drops the waiting future).
struct Queued<'a, F: Fn(usize)> {
    admission: &'a Admission,
    seq: u64,
    class: &'a str,
    on_depth: &'a F,
}

impl<F: Fn(usize)> Queued<'_, F> {
    fn leave(&self, w: &mut Waiting) {
        w.entries.retain(|e| e.seq != self.seq);
        (self.on_depth)(
            w.entries
                .iter()
                .filter(|e| e.class.name == self.class)
                .count(),
        );
    }
}

impl<F: Fn(usize)> Drop for Queued<'_, F> {
    fn drop(&mut self) {
        let mut w = self
            .admission
            .waiting
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        self.leave(&mut w);
    }
}
