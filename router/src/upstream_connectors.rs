//! Each thread's upstream connector, built before the thread's first request needs it.
//!
//! One per thread: a connection is registered with the runtime of the thread that opened it,
//! and each of its reads is dispatched there, so a pool shared between threads would hand a
//! request connections whose every read wakes another thread. Building one reads the
//! system's root certificates twice (for HTTP/1 and HTTP/2), milliseconds of work that, done
//! on a thread's first request, would stall every connection that thread serves; so the
//! threads known at start take connectors built then.

use pingora_core::connectors::http::Connector;
use pingora_core::connectors::ConnectorOptions;
use std::sync::{Mutex, PoisonError};
use thread_local::ThreadLocal;

pub struct UpstreamConnectors {
    options: ConnectorOptions,
    of_thread: ThreadLocal<Connector>,
    /// Built at start, for threads that have not asked yet.
    built_ahead: Mutex<Vec<Connector>>,
}

impl UpstreamConnectors {
    /// Builds `ahead` connectors now, for as many threads to come.
    pub fn new(options: ConnectorOptions, ahead: usize) -> Self {
        let built_ahead = (0..ahead)
            .map(|_| Connector::new(Some(options.clone())))
            .collect();
        UpstreamConnectors {
            options,
            of_thread: ThreadLocal::new(),
            built_ahead: Mutex::new(built_ahead),
        }
    }

    /// This thread's connector: one built ahead, or built now once none is left.
    pub fn get(&self) -> &Connector {
        self.of_thread.get_or(|| {
            let ahead = self
                .built_ahead
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .pop();
            ahead.unwrap_or_else(|| Connector::new(Some(self.options.clone())))
        })
    }

    #[cfg(test)]
    fn left_ahead(&self) -> usize {
        self.built_ahead
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_thread_keeps_its_own_connector_and_takes_one_built_ahead_while_any_is_left() {
        let connectors = UpstreamConnectors::new(ConnectorOptions::new(4), 2);
        assert_eq!(connectors.left_ahead(), 2);
        let mine = connectors.get() as *const Connector as usize;
        assert_eq!(connectors.get() as *const Connector as usize, mine);
        assert_eq!(connectors.left_ahead(), 1);
        // Two more threads alive at once (an exited thread's slot may pass to the next).
        let both_asked = std::sync::Barrier::new(2);
        let theirs: Vec<usize> = std::thread::scope(|s| {
            let ask = || {
                let got = connectors.get() as *const Connector as usize;
                both_asked.wait();
                got
            };
            let threads = [s.spawn(ask), s.spawn(ask)];
            threads.map(|t| t.join().unwrap()).to_vec()
        });
        // One took the last built ahead, the other built its own.
        assert_eq!(connectors.left_ahead(), 0);
        assert!(!theirs.contains(&mine));
        assert_ne!(theirs[0], theirs[1]);
    }
}
