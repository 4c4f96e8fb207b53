//! Stopping without cutting anyone off. SIGTERM, and the SIGQUIT of a graceful upgrade (the
//! new process takes the listening sockets), stop new connections; requests in flight may
//! finish for up to `shutdown_grace_ms`; streams still running then end with an error event
//! and unanswered requests get 503; the process exits as soon as nothing is in flight.

use async_trait::async_trait;
use pingora_core::server::{ShutdownSignal, ShutdownSignalWatch, ShutdownWatch};
use pingora_core::services::background::BackgroundService;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::watch;

/// How long after the last request ends the process takes to exit (buffers flushed).
const EXIT_POLL: Duration = Duration::from_millis(50);

pub struct Drain {
    /// When the grace period ends, once a stop has begun.
    deadline: watch::Sender<Option<Instant>>,
    active: AtomicUsize,
}

impl Default for Drain {
    fn default() -> Self {
        Drain {
            deadline: watch::Sender::new(None),
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
        self.deadline.send_if_modified(|d| {
            let first = d.is_none();
            if first {
                *d = Some(Instant::now() + grace);
            }
            first
        });
    }

    /// Resolves when the grace period is over; never while the gateway is not stopping.
    pub async fn grace_over(&self) {
        let mut deadline = self.deadline.subscribe();
        let Ok(at) = deadline.wait_for(Option::is_some).await.map(|d| *d) else {
            return std::future::pending().await;
        };
        match at {
            Some(at) => tokio::time::sleep_until(at.into()).await,
            None => std::future::pending().await,
        }
    }

    pub fn enter(&self) -> Active<'_> {
        self.active.fetch_add(1, Ordering::AcqRel);
        Active(self)
    }

    fn active(&self) -> usize {
        self.active.load(Ordering::Acquire)
    }
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
