//! The prefill side's transfers waiting for their decode worker: bounded in bytes and in
//! number, each kept until it is pulled once or its time to live ends, oldest dropped first.
//! Ids are random, so a transfer is read only by whoever was given its id.

use super::Transfer;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Most transfers waiting at once (the sim backend's blocks hold no bytes to bound them).
const MAX_TRANSFERS: usize = 65_536;

pub struct TransferStore {
    capacity_bytes: usize,
    ttl: Duration,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    transfers: HashMap<u64, (Arc<Transfer>, Instant)>,
    /// Ids in the order they were kept (ids already pulled are skipped when met).
    order: VecDeque<u64>,
    used_bytes: usize,
}

impl Inner {
    fn remove(&mut self, id: u64) -> Option<Arc<Transfer>> {
        let (transfer, _) = self.transfers.remove(&id)?;
        self.used_bytes -= transfer.bytes();
        Some(transfer)
    }

    fn drop_oldest(&mut self) {
        while let Some(id) = self.order.pop_front() {
            if self.remove(id).is_some() {
                return;
            }
        }
    }

    fn drop_expired(&mut self, now: Instant) {
        while let Some(&id) = self.order.front() {
            match self.transfers.get(&id) {
                Some((_, expires)) if *expires > now => return,
                _ => {
                    self.order.pop_front();
                    self.remove(id);
                }
            }
        }
    }
}

impl TransferStore {
    pub fn new(capacity_bytes: usize, ttl: Duration) -> Self {
        TransferStore {
            capacity_bytes,
            ttl,
            inner: Mutex::default(),
        }
    }

    /// Keeps `transfer` and returns its id; `None` when it alone exceeds the capacity or the
    /// system gives no randomness. Older transfers make room.
    pub fn keep(&self, transfer: Transfer, now: Instant) -> Option<u64> {
        let bytes = transfer.bytes();
        if bytes > self.capacity_bytes {
            return None;
        }
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        inner.drop_expired(now);
        while inner.used_bytes + bytes > self.capacity_bytes
            || inner.transfers.len() >= MAX_TRANSFERS
        {
            inner.drop_oldest();
        }
        let id = loop {
            let id = random_id()?;
            if !inner.transfers.contains_key(&id) {
                break id;
            }
        };
        inner.used_bytes += bytes;
        inner
            .transfers
            .insert(id, (Arc::new(transfer), now + self.ttl));
        inner.order.push_back(id);
        Some(id)
    }

    /// The transfer `id`, taken out: a transfer is pulled once. `None` when unknown, pulled
    /// already, dropped for room, or expired.
    pub fn take(&self, id: u64, now: Instant) -> Option<Arc<Transfer>> {
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        inner.drop_expired(now);
        inner.remove(id)
    }

    /// Transfers waiting, and their bytes.
    pub fn usage(&self) -> (usize, usize) {
        let inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        (inner.transfers.len(), inner.used_bytes)
    }
}

fn random_id() -> Option<u64> {
    let mut bytes = [0u8; 8];
    getrandom::fill(&mut bytes).ok()?;
    Some(u64::from_le_bytes(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transfer::TransferBlock;

    fn transfer(bytes: usize) -> Transfer {
        Transfer {
            blocks: vec![TransferBlock {
                hash: bytes as u64,
                parent: None,
                data: vec![7u8; bytes].into(),
            }],
        }
    }

    #[test]
    fn a_transfer_is_taken_once_and_its_bytes_come_back() {
        let store = TransferStore::new(1000, Duration::from_secs(30));
        let now = Instant::now();
        let id = store.keep(transfer(400), now).unwrap();
        assert_eq!(store.usage(), (1, 400));
        assert_eq!(store.take(id, now).unwrap().bytes(), 400);
        assert!(store.take(id, now).is_none());
        assert_eq!(store.usage(), (0, 0));
    }

    #[test]
    fn the_oldest_transfers_make_room_and_one_too_large_is_refused() {
        let store = TransferStore::new(1000, Duration::from_secs(30));
        let now = Instant::now();
        let first = store.keep(transfer(400), now).unwrap();
        let second = store.keep(transfer(400), now).unwrap();
        let third = store.keep(transfer(400), now).unwrap();
        assert!(store.take(first, now).is_none());
        assert_eq!(store.usage(), (2, 800));
        assert!(store.keep(transfer(1001), now).is_none());
        assert!(store.take(second, now).is_some() && store.take(third, now).is_some());
    }

    #[test]
    fn an_expired_transfer_is_gone_and_frees_its_bytes() {
        let store = TransferStore::new(1000, Duration::from_secs(30));
        let now = Instant::now();
        let id = store.keep(transfer(400), now).unwrap();
        let later = now + Duration::from_secs(31);
        assert!(store.take(id, later).is_none());
        assert_eq!(store.usage(), (0, 0));
    }
}
