//! When a replica's engine step under way will end, as the tokens streaming back through the
//! gateway show. An engine batches every running request into steps, each ending with a token
//! for each; a request sent mid-step waits for the rest of that step before its prefill
//! starts. Where the rest of the work ahead is alike (one system prompt held everywhere, light
//! load), the replica whose step ends soonest gives the first token soonest.
//!
//! A stream's consecutive tokens are a step apart, so each stream's gaps give the step's
//! length and its latest token when the last step ended; the tokens of one step reaching the
//! gateway from many streams at slightly different times need no telling apart. The proxy
//! threads tell it of each chunk they pass on without taking the fleet's lock: two atomics,
//! where a lost update between two threads costs one observation.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Each step's weight in the learnt length: about the last 8 count.
const WEIGHT: u64 = 8;
/// A gap longer than this many steps counts as this many: the stream was preempted, or the
/// engine ran a long prefill, and the next steps are the usual ones.
const LONGEST: u64 = 3;

#[derive(Debug, Default)]
pub struct StepClock {
    /// When a step last ended, as its latest token showed (µs on the gateway's clock; 0: none).
    last_us: AtomicU64,
    /// The learnt length of a step (µs; 0: not yet).
    step_us: AtomicU64,
}

impl StepClock {
    /// A token (or a chunk of them) of one of the replica's streams arrived at `now_us`; the
    /// stream's previous one at `previous_us` (`None` for its first).
    pub fn token(&self, now_us: u64, previous_us: Option<u64>) {
        self.last_us.fetch_max(now_us, Relaxed);
        let Some(gap) = previous_us
            .map(|p| now_us.saturating_sub(p))
            .filter(|&g| g > 0)
        else {
            return;
        };
        let step = match self.step_us.load(Relaxed) {
            0 => gap,
            step => step + gap.min(step.saturating_mul(LONGEST)) / WEIGHT - step / WEIGHT,
        };
        self.step_us.store(step.max(1), Relaxed);
    }

    /// How long a request sent at `now_us` likely waits for the step under way to end: what is
    /// left of a step since the last one ended; half a step once that is overdue (a longer step
    /// than the last ones, of unknown length); 0 while nothing is known.
    pub fn wait_us(&self, now_us: u64) -> u64 {
        let step = self.step_us.load(Relaxed);
        let due = self.last_us.load(Relaxed).saturating_add(step);
        match step {
            0 => 0,
            _ if due > now_us => due - now_us,
            _ => step / 2,
        }
    }
}

impl PartialEq for StepClock {
    fn eq(&self, other: &Self) -> bool {
        self.last_us.load(Relaxed) == other.last_us.load(Relaxed)
            && self.step_us.load(Relaxed) == other.step_us.load(Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_is_known_before_a_stream_shows_a_step() {
        let c = StepClock::default();
        assert_eq!(c.wait_us(1_000), 0);
        // Two streams' first tokens: when a step ended, not how long one takes.
        c.token(1_000, None);
        c.token(1_200, None);
        assert_eq!(c.wait_us(1_500), 0);
    }

    #[test]
    fn the_wait_is_what_is_left_of_the_learnt_step_then_half_a_step_once_overdue() {
        let c = StepClock::default();
        c.token(10_000, None);
        c.token(15_000, Some(10_000));
        // Steps of 5 ms, the last ending at 15 ms.
        assert_eq!(c.wait_us(16_000), 4_000);
        assert_eq!(c.wait_us(19_999), 1);
        assert_eq!(c.wait_us(20_000), 2_500);
        assert_eq!(c.wait_us(90_000), 2_500);
    }

    #[test]
    fn tokens_of_one_step_from_many_streams_move_its_end_not_its_length() {
        let c = StepClock::default();
        c.token(10_000, None);
        c.token(15_000, Some(10_000));
        // Other streams' tokens of the same step, a little later, and one late to arrive.
        c.token(15_300, Some(10_300));
        c.token(15_400, None);
        c.token(14_000, Some(9_000));
        assert_eq!(c.wait_us(16_000), 4_400);
    }

    #[test]
    fn the_step_length_follows_recent_steps_and_a_long_gap_counts_as_three_steps() {
        let c = StepClock::default();
        c.token(16_000, Some(8_000));
        // 8 ms, then a 4 ms step: 8 - 8/8 + 4/8 = 7.5 ms.
        c.token(20_000, Some(16_000));
        assert_eq!(c.wait_us(20_000), 7_500);
        // A stream idle a second counts three steps (22.5 ms): 7.5 + 22.5/8 - 7.5/8 = 9.375.
        c.token(1_020_000, Some(20_000));
        assert_eq!(c.wait_us(1_020_000), 9_375);
        // A long first gap is forgotten as steps come: after 40 of 5 ms, within 2% of 5 ms.
        for k in 1..=40 {
            c.token(1_020_000 + 5_000 * k, Some(1_015_000 + 5_000 * k));
        }
        assert!(
            c.wait_us(1_220_000).abs_diff(5_000) < 100,
            "{}",
            c.wait_us(1_220_000)
        );
    }
}
