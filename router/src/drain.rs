//! Stopping without cutting anyone off. SIGTERM, and the SIGQUIT of a graceful upgrade (the
//! new process takes the listening sockets), stop new connections; requests in flight may
//! finish for up to `shutdown_grace_ms`; streams still running then end with an error event
//! and unanswered requests get 503; the process exits as soon as nothing is in flight.

use async_trait::async_trait;
use pingora_core::server::{ShutdownSignal, ShutdownSignalWatch, ShutdownWatch};
use pingora_core::services::background::BackgroundService;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::Notify;

/// How long after the last request ends the process takes to exit (buffers flushed).
const EXIT_POLL: Duration = Duration::from_millis(50);

/// Every request waits for the grace period's end on its thread's own `Notify` (threads past
/// this many share them): a wait registered on one shared by all threads would move its lock's
/// cache line between them several times a request.
const WAIT_SHARDS: usize = 64;

/// A `Notify` on a cache line of its own.
#[repr(align(128))]
#[derive(Default)]
struct Shard(Notify);

pub struct Drain {
    /// When the grace period ends, once a stop has begun.
    deadline: OnceLock<Instant>,
    /// Woken when a stop begins.
    stopping: Box<[Shard]>,
    active: AtomicUsize,
}

impl Default for Drain {
    fn default() -> Self {
        Drain {
            deadline: OnceLock::new(),
            stopping: (0..WAIT_SHARDS).map(|_| Shard::default()).collect(),
            active: AtomicUsize::new(0),
        }
    }
}

/// A request in flight, counted until dropped.
pub struct Active<'a>(&'a Drain);

impl Drop for Active<'_> {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Drain {
    /// Starts the grace period (the first stop counts; a second one does not extend it).
    pub fn start(&self, grace: Duration) {
        if self.deadline.set(Instant::now() + grace).is_ok() {
            for shard in &self.stopping {
                shard.0.notify_waiters();
            }
        }
    }

    /// Resolves when the grace period is over; never while the gateway is not stopping.
    pub async fn grace_over(&self) {
        let stopping = self.stopping[this_thread_shard()].0.notified();
        tokio::pin!(stopping);
        // Registered before the deadline is looked at, so a stop beginning between the two
        // still wakes it.
        stopping.as_mut().enable();
        let at = match self.deadline.get() {
            Some(at) => *at,
            None => {
                stopping.await;
                match self.deadline.get() {
                    Some(at) => *at,
                    None => return std::future::pending().await,
                }
            }
        };
        tokio::time::sleep_until(at.into()).await;
    }

    pub fn enter(&self) -> Active<'_> {
        self.active.fetch_add(1, Ordering::AcqRel);
        Active(self)
    }

    fn active(&self) -> usize {
        self.active.load(Ordering::Acquire)
    }
}

/// This thread's shard of [`Drain::stopping`], drawn in turn at its first wait.
fn this_thread_shard() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static SHARD: usize = NEXT.fetch_add(1, Ordering::Relaxed) % WAIT_SHARDS;
    }
    SHARD.with(|shard| *shard)
}

/// The signals Pingora acts on, with the grace period started first.
pub struct Signals {
    pub gateway: Arc<crate::Gateway>,
    pub grace: Duration,
}

#[async_trait]
impl ShutdownSignalWatch for Signals {
    async fn recv(&self) -> ShutdownSignal {
        let listen = |kind| {
            signal(kind).map_err(|e| tracing::error!(error = %e, "cannot listen for a stop signal"))
        };
        let (Ok(mut quit), Ok(mut term), Ok(mut int)) = (
            listen(SignalKind::quit()),
            listen(SignalKind::terminate()),
            listen(SignalKind::interrupt()),
        ) else {
            return std::future::pending().await;
        };
        let drain = &self.gateway.drain;
        tokio::select! {
            _ = quit.recv() => {
                // Pingora hands the sockets over, then keeps accepting for 5 s.
                drain.start(self.grace + Duration::from_secs(5));
                tracing::info!(grace = ?self.grace, "SIGQUIT: handing the listeners to the new process, then draining");
                ShutdownSignal::GracefulUpgrade
            }
            _ = term.recv() => {
                drain.start(self.grace);
                tracing::info!(grace = ?self.grace, "SIGTERM: draining");
                ShutdownSignal::GracefulTerminate
            }
            _ = int.recv() => ShutdownSignal::FastShutdown,
        }
    }
}

/// Ends the process once the listeners are closed and nothing is in flight, instead of
/// sleeping out the whole grace period as Pingora would.
pub struct ExitWhenIdle {
    pub gateway: Arc<crate::Gateway>,
    pub before_exit: Option<fn()>,
}

#[async_trait]
impl BackgroundService for ExitWhenIdle {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        if shutdown.wait_for(|stopping| *stopping).await.is_err() {
            return;
        }
        loop {
            if self.gateway.drain.active() == 0 {
                tracing::info!("nothing in flight: exiting");
                if let Some(flush) = self.before_exit {
                    flush();
                }
                std::process::exit(0);
            }
            tokio::time::sleep(EXIT_POLL).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;
    use std::task::{Context, Poll, Waker};

    const GRACE: Duration = Duration::from_millis(300);

    fn assert_grace_passed(stopped: Instant) {
        let waited = stopped.elapsed();
        assert!(waited >= GRACE, "over after {waited:?}");
    }

    fn polled(future: &mut std::pin::Pin<&mut impl Future<Output = ()>>) -> bool {
        future
            .as_mut()
            .poll(&mut Context::from_waker(Waker::noop()))
            == Poll::Ready(())
    }

    #[tokio::test]
    async fn a_wait_begun_before_the_stop_ends_with_the_grace_period_not_before() {
        let drain = Arc::new(Drain::default());
        let over = drain.grace_over();
        tokio::pin!(over);
        assert!(!polled(&mut over));
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!polled(&mut over), "over without a stop");
        // The stop comes from another thread, as a signal's task may run on one.
        let stopped = Instant::now();
        let stopper = Arc::clone(&drain);
        std::thread::spawn(move || stopper.start(GRACE))
            .join()
            .unwrap();
        assert!(!polled(&mut over), "over at the stop");
        tokio::time::timeout(GRACE * 5, over)
            .await
            .expect("woken by the stop, then the grace period's end");
        assert_grace_passed(stopped);
    }

    #[tokio::test]
    async fn a_wait_begun_during_the_stop_ends_with_its_first_grace_period() {
        let drain = Drain::default();
        let stopped = Instant::now();
        drain.start(GRACE);
        // A second stop does not extend the first one's grace period.
        drain.start(GRACE * 100);
        tokio::time::timeout(GRACE * 5, drain.grace_over())
            .await
            .expect("over with the first grace period");
        assert_grace_passed(stopped);
    }
}
