//! Keeps one worker process running: starts it, restarts it with exponential back-off when it
//! exits, and stops it gracefully (SIGTERM, then SIGKILL after a grace period).

use std::time::{Duration, Instant};
use tokio::process::{Child, Command};
use tokio::sync::watch;

/// Restart delays: doubling from `first` to `max`; back to `first` once a process has run for
/// `reset_after`.
#[derive(Debug, Clone)]
pub struct Backoff {
    pub first: Duration,
    pub max: Duration,
    pub reset_after: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            first: Duration::from_millis(500),
            max: Duration::from_secs(30),
            reset_after: Duration::from_secs(60),
        }
    }
}

impl Backoff {
    /// The delay before restart number `restarts` (0-based) of a process that ran `ran`.
    pub fn delay(&self, restarts: u32, ran: Duration) -> Duration {
        if ran >= self.reset_after {
            return self.first;
        }
        self.first
            .saturating_mul(1u32 << restarts.min(16))
            .min(self.max)
    }
}

/// How long a worker gets to exit after SIGTERM (a kvgate worker finishes its requests in
/// flight for up to 25 s).
const GRACE: Duration = Duration::from_secs(30);

/// Runs `command` until `stop` turns true. Each start publishes a new instance number (the
/// start time in milliseconds since the Unix epoch) on `instance`.
pub async fn supervise(
    command: Vec<String>,
    backoff: Backoff,
    instance: watch::Sender<u64>,
    mut stop: watch::Receiver<bool>,
) {
    let Some((program, args)) = command.split_first() else {
        tracing::error!("no worker command to supervise");
        return;
    };
    let mut restarts = 0u32;
    loop {
        let started = Instant::now();
        let (key, value) = crate::lineage::parent_env();
        let spawned = Command::new(program)
            .args(args)
            .env(key, value)
            .kill_on_drop(true)
            .spawn();
        let mut child = match spawned {
            Ok(child) => child,
            Err(e) => {
                tracing::error!(%program, error = %e, "cannot start the worker");
                let delay = backoff.delay(restarts, Duration::ZERO);
                restarts += 1;
                if wait_or_stop(delay, &mut stop).await {
                    return;
                }
                continue;
            }
        };
        let _ = instance.send(unix_ms());
        tracing::info!(pid = child.id(), "worker started");
        let exited = tokio::select! {
            status = child.wait() => Some(status),
            _ = stop.wait_for(|s| *s) => None,
        };
        let Some(status) = exited else {
            stop_gracefully(&mut child).await;
            return;
        };
        let ran = started.elapsed();
        let delay = backoff.delay(restarts, ran);
        restarts = if ran >= backoff.reset_after {
            1
        } else {
            restarts + 1
        };
        tracing::warn!(?status, ?ran, ?delay, "worker exited; restarting");
        if wait_or_stop(delay, &mut stop).await {
            return;
        }
    }
}

/// Sleeps `delay`; true if `stop` turned true meanwhile.
async fn wait_or_stop(delay: Duration, stop: &mut watch::Receiver<bool>) -> bool {
    let stopped = tokio::select! {
        _ = tokio::time::sleep(delay) => false,
        _ = stop.wait_for(|s| *s) => true,
    };
    stopped || *stop.borrow()
}

/// SIGTERM, then SIGKILL if the worker is still there after the grace period.
async fn stop_gracefully(child: &mut Child) {
    if let Some(pid) = child.id() {
        crate::lineage::terminate(pid);
        if tokio::time::timeout(GRACE, child.wait()).await.is_ok() {
            tracing::info!(pid, "worker stopped");
            return;
        }
        tracing::warn!(pid, "worker ignored SIGTERM; killing it");
    }
    let _ = child.kill().await;
}

pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_caps_and_resets() {
        let b = Backoff::default();
        let short = Duration::from_secs(1);
        assert_eq!(b.delay(0, short), Duration::from_millis(500));
        assert_eq!(b.delay(1, short), Duration::from_secs(1));
        assert_eq!(b.delay(3, short), Duration::from_secs(4));
        assert_eq!(b.delay(40, short), Duration::from_secs(30));
        assert_eq!(
            b.delay(40, Duration::from_secs(61)),
            Duration::from_millis(500)
        );
    }
}
