//! The KV-event log: sequence-numbered batches, the last `capacity` retained for replay, and a
//! live feed. A subscriber replays from a sequence number, or, if that is no longer retained,
//! is told to start from a snapshot.

use kvgate_protocol::kv_events::{KvEvent, KvEventBatch, KV_EVENTS_VERSION};
use std::collections::VecDeque;
use std::sync::Arc;
use tokio::sync::broadcast;

pub struct EventLog {
    next_seq: u64,
    retained: VecDeque<Arc<KvEventBatch>>,
    capacity: usize,
    live: broadcast::Sender<Arc<KvEventBatch>>,
}

/// Retained batches to replay, then the live feed.
#[derive(Debug)]
pub struct Subscription {
    pub replay: Vec<Arc<KvEventBatch>>,
    pub live: broadcast::Receiver<Arc<KvEventBatch>>,
}

/// The replay a subscriber asked for is gone: it must resynchronise from a snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gone {
    pub oldest: u64,
}

impl EventLog {
    pub fn new(capacity: usize) -> Self {
        let (live, _) = broadcast::channel(capacity.max(16));
        EventLog {
            next_seq: 1,
            retained: VecDeque::new(),
            capacity: capacity.max(1),
            live,
        }
    }

    /// The sequence number of the last published batch (0 before any).
    pub fn last_seq(&self) -> u64 {
        self.next_seq - 1
    }

    pub fn publish(&mut self, events: Vec<KvEvent>) {
        if events.is_empty() {
            return;
        }
        let batch = Arc::new(KvEventBatch {
            version: KV_EVENTS_VERSION,
            seq: self.next_seq,
            events,
        });
        self.next_seq += 1;
        if self.retained.len() == self.capacity {
            self.retained.pop_front();
        }
        self.retained.push_back(Arc::clone(&batch));
        // No subscriber is fine.
        let _ = self.live.send(batch);
    }

    /// Batches from `from` on that are retained, and a live feed for the rest (subscribed
    /// under the same lock, so nothing falls between them). A `from` past the next batch is
    /// gone too: the subscriber knew a log from before a restart.
    pub fn subscribe(&self, from: u64) -> Result<Subscription, Gone> {
        let oldest = self.retained.front().map_or(self.next_seq, |b| b.seq);
        if (from < oldest && from < self.next_seq) || from > self.next_seq {
            return Err(Gone { oldest });
        }
        let replay = self
            .retained
            .iter()
            .filter(|b| b.seq >= from)
            .cloned()
            .collect();
        Ok(Subscription {
            replay,
            live: self.live.subscribe(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replays_what_is_retained_and_refuses_what_is_gone() {
        let mut log = EventLog::new(2);
        for _ in 0..3 {
            log.publish(vec![KvEvent::AllCleared]);
        }
        log.publish(vec![]);
        assert_eq!(log.last_seq(), 3);
        assert_eq!(log.subscribe(1).unwrap_err(), Gone { oldest: 2 });
        let replay = log.subscribe(2).unwrap().replay;
        assert_eq!(replay.iter().map(|b| b.seq).collect::<Vec<_>>(), vec![2, 3]);
        assert!(
            log.subscribe(4).unwrap().replay.is_empty(),
            "the next batch is live only"
        );
        assert_eq!(
            log.subscribe(9).unwrap_err(),
            Gone { oldest: 2 },
            "a log from before a restart"
        );
    }
}
