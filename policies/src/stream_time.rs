//! How long a replica's requests hold their KV blocks while they decode: from a stream's first
//! token to its last, as the gateway saw it. Where its engine has no KV room left, a request
//! queued there starts only as running ones end and free their blocks: with `n` running, one
//! about every `stream time / n`.

/// Each stream's weight against the ones before: about the last 16 count.
const DECAY: f64 = 15.0 / 16.0;

#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct StreamTime {
    /// Decayed sums of the streams' lengths (µs) and of their number.
    total_us: f64,
    streams: f64,
}

impl StreamTime {
    /// A stream's first token came at `first_us`, its last at `last_us`.
    pub fn ended(&mut self, first_us: u64, last_us: u64) {
        self.total_us = self.total_us * DECAY + last_us.saturating_sub(first_us) as f64;
        self.streams = self.streams * DECAY + 1.0;
    }

    /// The streams' recent mean length (µs; `None` before the first).
    pub fn mean_us(&self) -> Option<f64> {
        (self.streams > 0.0).then(|| self.total_us / self.streams)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mean_follows_the_latest_streams() {
        let mut t = StreamTime::default();
        assert_eq!(t.mean_us(), None);
        t.ended(1_000, 3_000);
        assert_eq!(t.mean_us(), Some(2_000.0));
        for _ in 0..64 {
            t.ended(0, 10_000);
        }
        let mean = t.mean_us().unwrap_or_default();
        assert!((9_900.0..=10_000.0).contains(&mean), "{mean}");
        // A clock that went back counts as an empty stream, not a huge one.
        t.ended(5, 1);
        assert!(t.mean_us().unwrap_or_default() < mean);
    }
}
