//! Client connections open at once, bounded below the process's open-file limit. Without a
//! bound, a flood of idle connections takes every descriptor: Pingora's accept then fails
//! (EMFILE) once a second, every new client times out, and the gateway cannot open
//! connections to its replicas either. Past half the bound, connections waiting for their
//! first bytes or their next request are closed at each second's check until at most half are
//! open (as Envoy's overload manager shortens its timeouts), in seconds rather than a minute.
//! Checks racing each other may close one more than needed.

use crate::config::Limits;
use pingora_timeout::fast_timeout::fast_timeout;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// How often a waiting connection asks whether more than half the bound is open.
const PRESSURE_CHECK: Duration = Duration::from_secs(1);

/// Descriptors left for replicas, agents, peers, the admin listener and files when the bound
/// is derived from the open-file limit: a quarter of it.
const RESERVED_SHARE: u64 = 4;

pub struct Connections {
    open: AtomicUsize,
    /// The bound when the config sets none.
    default_max: usize,
}

/// An open client connection, counted until dropped.
pub struct Open<'a>(&'a Connections);

impl Drop for Open<'_> {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Default for Connections {
    /// Bounded by three quarters of the process's open-file limit as it is now.
    fn default() -> Self {
        let files = open_file_limit().unwrap_or(1024);
        Connections {
            open: AtomicUsize::new(0),
            default_max: usize::try_from(files - files / RESERVED_SHARE).unwrap_or(usize::MAX),
        }
    }
}

impl Connections {
    /// The bound: `limits.max_connections`, else three quarters of the open-file limit.
    pub fn max(&self, limits: &Limits) -> usize {
        limits.max_connections.map_or(self.default_max, |m| {
            usize::try_from(m.get()).unwrap_or(usize::MAX)
        })
    }

    /// Counts a new connection; `None`, counting nothing, when `max` are open already.
    pub fn enter(&self, max: usize) -> Option<Open<'_>> {
        let before = self.open.fetch_add(1, Ordering::AcqRel);
        if before >= max {
            self.open.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        Some(Open(self))
    }

    /// Whether more than half of `max` are open.
    pub fn pressed(&self, max: usize) -> bool {
        self.open() > max / 2
    }

    pub fn open(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }
}

/// How a wait on a connection ended.
pub enum Waited<T> {
    Done(T),
    TimedOut,
    /// Given up for a connection in excess while too many are open.
    Shed,
}

/// Polls `work` until it is done, `deadline` passes, or `pressed`, asked every
/// [`PRESSURE_CHECK`], says too many connections are open. One future is polled throughout: a
/// read dropped half-way would lose what it had read. Pingora's coarse timer is armed only
/// when `work` is not done at once.
pub async fn unless_shed<F: Future>(
    work: F,
    deadline: Duration,
    pressed: impl Fn() -> bool,
) -> Waited<F::Output> {
    let mut work = std::pin::pin!(work);
    let mut waited = Duration::ZERO;
    while waited < deadline {
        let slice = PRESSURE_CHECK.min(deadline - waited);
        match fast_timeout(slice, &mut work).await {
            Ok(done) => return Waited::Done(done),
            Err(_) if pressed() => return Waited::Shed,
            Err(_) => waited += slice,
        }
    }
    Waited::TimedOut
}

/// The soft open-file limit.
fn open_file_limit() -> Option<u64> {
    nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .ok()
        .map(|(soft, _)| soft)
}

/// Raises the soft open-file limit to the hard one, as nginx's `worker_rlimit_nofile` and Go's
/// runtime do (where it cannot, the limit stays as it was).
pub fn raise_open_file_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        if soft < hard {
            let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bound(max: u64) -> Limits {
        Limits {
            max_connections: std::num::NonZeroU64::new(max),
            ..Limits::default()
        }
    }

    #[test]
    fn connections_past_the_bound_are_refused_until_one_closes() {
        let c = Connections::default();
        let max = c.max(&bound(3));
        let open: Vec<_> = (0..3).filter_map(|_| c.enter(max)).collect();
        assert_eq!(open.len(), 3);
        assert!(c.enter(max).is_none());
        assert_eq!(c.open(), 3, "a refused connection is not counted");
        assert!(c.pressed(max));
        drop(open);
        assert_eq!(c.open(), 0);
        assert!(!c.pressed(max));
        assert!(c.enter(max).is_some());
    }

    #[test]
    fn the_default_bound_leaves_a_quarter_of_the_open_file_limit() {
        let c = Connections::default();
        let files = open_file_limit().unwrap_or(1024);
        assert_eq!(c.max(&Limits::default()) as u64, files - files / 4);
        assert_eq!(c.max(&bound(10)), 10);
    }
}
