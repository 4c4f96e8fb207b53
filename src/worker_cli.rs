//! `kvgate worker`'s connection deadlines.

use kvgate_worker::server::Deadlines;
use std::time::Duration;

/// The longest deadline a flag takes: an hour.
const MAX_DEADLINE_MS: u64 = 3_600_000;

#[derive(clap::Args, Clone, Debug)]
pub struct DeadlineArgs {
    /// A request's whole header within this, counted from when its connection awaits one: on
    /// a kept-alive connection from its previous answer, so this is also how long an idle
    /// connection stays open. Keep it above the gateway's `pool_idle_ms` (30 s), so that the
    /// gateway, not the worker, closes the idle connections its pool keeps. Over it, the
    /// connection is closed.
    #[arg(long, default_value_t = 75_000)]
    pub header_timeout_ms: u64,
    /// A request's whole body within this after its header: 408, connection closed.
    #[arg(long, default_value_t = 60_000)]
    pub body_timeout_ms: u64,
}

impl DeadlineArgs {
    pub fn deadlines(&self) -> Result<Deadlines, String> {
        let within = |flag: &str, ms: u64| {
            if (1..=MAX_DEADLINE_MS).contains(&ms) {
                Ok(Duration::from_millis(ms))
            } else {
                Err(format!(
                    "{flag} must be between 1 and {MAX_DEADLINE_MS}, got {ms}"
                ))
            }
        };
        Ok(Deadlines {
            header: within("--header-timeout-ms", self.header_timeout_ms)?,
            body: within("--body-timeout-ms", self.body_timeout_ms)?,
        })
    }
}

/// `mib` MiB in bytes, or why `flag`'s value cannot be.
pub fn mib_to_bytes(flag: &str, mib: usize) -> Result<usize, String> {
    mib.checked_mul(1 << 20)
        .ok_or_else(|| format!("{flag} {mib} is more than this machine can name"))
}
