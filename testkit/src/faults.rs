//! The faults a test worker injects, changeable at run time through `POST /fault`.

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64_with_seed;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Faults {
    /// Delay before the first token.
    pub first_token_delay_ms: u64,
    /// Delay between tokens.
    pub token_delay_ms: u64,
    /// Fraction of generation requests answered with `error_status` at once.
    pub error_rate: f64,
    pub error_status: u16,
    /// Fraction of generation requests that never get an answer.
    pub hang_rate: f64,
    /// Fraction of streamed requests whose connection is dropped after `disconnect_after` tokens.
    pub disconnect_rate: f64,
    pub disconnect_after: u32,
    /// Fraction of generation requests answered 200 with a body that is no OpenAI response:
    /// events whose data is not JSON, then bytes without framing.
    pub garbage_rate: f64,
    /// What `/health` reports.
    pub healthy: bool,
}

impl Default for Faults {
    fn default() -> Self {
        Faults {
            first_token_delay_ms: 0,
            token_delay_ms: 0,
            error_rate: 0.0,
            error_status: 503,
            hang_rate: 0.0,
            disconnect_rate: 0.0,
            disconnect_after: 2,
            garbage_rate: 0.0,
            healthy: true,
        }
    }
}

/// What happens to one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    Serve,
    Error(u16),
    Hang,
    /// Stream this many tokens, then drop the connection.
    DisconnectAfter(u32),
    Garbage,
}

impl Faults {
    /// Decides request number `n`'s fate deterministically from `seed`.
    pub fn fate(&self, seed: u64, n: u64) -> Fate {
        let draw = |salt: u64| {
            (xxh3_64_with_seed(&n.to_le_bytes(), seed ^ salt) as f64) / (u64::MAX as f64)
        };
        if draw(1) < self.error_rate {
            Fate::Error(self.error_status)
        } else if draw(2) < self.hang_rate {
            Fate::Hang
        } else if draw(3) < self.disconnect_rate {
            Fate::DisconnectAfter(self.disconnect_after)
        } else if draw(4) < self.garbage_rate {
            Fate::Garbage
        } else {
            Fate::Serve
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fates_follow_the_rates() {
        let f = Faults {
            error_rate: 0.25,
            ..Faults::default()
        };
        let errors = (0..4000)
            .filter(|&n| f.fate(9, n) == Fate::Error(503))
            .count();
        assert!((800..1200).contains(&errors), "{errors}");
        assert!((0..100).all(|n| Faults::default().fate(9, n) == Fate::Serve));
    }
}
