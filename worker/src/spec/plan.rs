//! How many drafted tokens a step verifies. A request's draft is kept in runs: its first token
//! with the request's running rate `f`, each later one, once those before it were kept, with
//! its running continuation rate `c` (copying from a given text, that is high even where the
//! first is a coin toss). So the `j`-th drafted token yields a token with probability
//! `f · c^(j-1)` (it and every one before it kept). A step's cost grows with its tokens as the backend
//! measured it. The step verifies the most valuable drafted tokens, as many as maximise the
//! expected tokens per unit of step cost, and none when no draft pays for its verification:
//! so drafts shrink as acceptance falls, and stop where the batch already fills the kernels.

/// A step's cost against its number of tokens, relative to a one-token step.
#[derive(Debug, Clone, PartialEq)]
pub struct StepCosts {
    /// (tokens, cost), by tokens, the first at one token; costs never fall.
    points: Vec<(usize, f64)>,
}

impl StepCosts {
    /// From measured (tokens, cost) points, in any order and any unit: costs become relative
    /// to the smallest step's, and a cost below a smaller step's (noise) is raised to it.
    pub fn from_points(mut points: Vec<(usize, f64)>) -> Result<Self, String> {
        points.retain(|&(n, _)| n > 0);
        points.sort_by_key(|&(n, _)| n);
        points.dedup_by_key(|p| p.0);
        let Some(&(_, base)) = points.first() else {
            return Err("no step costs measured".into());
        };
        if !(base.is_finite() && base > 0.0) || points.iter().any(|p| !p.1.is_finite()) {
            return Err(format!(
                "step costs must be positive and finite: {points:?}"
            ));
        }
        let mut floor = 0.0_f64;
        for p in &mut points {
            floor = floor.max(p.1 / base);
            p.1 = floor;
        }
        Ok(StepCosts { points })
    }

    /// Cost proportional to tokens: verification never pays (a backend that did not measure).
    pub fn linear() -> Self {
        StepCosts {
            points: vec![(1, 1.0), (2, 2.0)],
        }
    }

    /// The steps a backend should time (the rest are interpolated): every small one, where
    /// kernels' widths make the cost jump, then sparser up to `max_tokens` or 48.
    pub fn sizes_to_measure(max_tokens: usize) -> Vec<usize> {
        [1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48]
            .into_iter()
            .filter(|&n| n <= max_tokens.max(1))
            .collect()
    }

    /// The cost of a step of `tokens` tokens: interpolated between the measured points,
    /// extended past the last at the last segment's slope.
    pub fn cost(&self, tokens: usize) -> f64 {
        let tokens = tokens.max(1);
        let at = self.points.partition_point(|&(n, _)| n < tokens);
        let line = |(n0, c0): (usize, f64), (n1, c1): (usize, f64)| {
            c0 + (c1 - c0) * (tokens as f64 - n0 as f64) / (n1 - n0) as f64
        };
        match (at, self.points.len()) {
            (_, 1) => self.points[0].1 * tokens as f64,
            (at, len) if at < len && self.points[at].0 == tokens => self.points[at].1,
            (0, _) => self.points[0].1,
            (at, len) if at < len => line(self.points[at - 1], self.points[at]),
            (_, len) => line(self.points[len - 2], self.points[len - 1]),
        }
    }

    pub fn points(&self) -> &[(usize, f64)] {
        &self.points
    }
}

/// A running rate: events kept and missed, forgetting the oldest beyond `Rate::MEMORY`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Rate {
    kept: f64,
    missed: f64,
}

impl Rate {
    /// Observations a rate remembers: enough to be steady, few enough to follow a change of
    /// traffic within a few hundred drafts.
    const MEMORY: f64 = 256.0;

    fn record(&mut self, kept: f64, missed: f64) {
        self.kept += kept;
        self.missed += missed;
        let seen = self.seen();
        if seen > Self::MEMORY {
            let scale = Self::MEMORY / seen;
            self.kept *= scale;
            self.missed *= scale;
        }
    }

    /// Observations, as remembered.
    pub fn seen(&self) -> f64 {
        self.kept + self.missed
    }

    /// The rate, starting from `prior` as if it had been seen `weight` times.
    pub fn rate(&self, prior: f64, weight: f64) -> f64 {
        (self.kept + prior * weight) / (self.seen() + weight)
    }
}

/// How drafts fare: their first token's rate, and later tokens' once those before were kept.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Acceptance {
    pub first: Rate,
    pub then: Rate,
}

impl Acceptance {
    /// A draft of `drafted` tokens of which the first `kept` were kept (the rest unobserved
    /// after the first rejection).
    pub fn record(&mut self, drafted: usize, kept: usize) {
        if drafted == 0 {
            return;
        }
        self.first.record(f64::from(kept > 0), f64::from(kept == 0));
        if kept > 0 && drafted > 1 {
            self.then
                .record((kept - 1) as f64, f64::from(kept < drafted));
        }
    }
}

/// A request that has a draft to offer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Offer {
    /// The chance its first drafted token is kept.
    pub first: f64,
    /// The chance each later one is, once those before it were.
    pub then: f64,
    /// Tokens drafted.
    pub len: usize,
}

/// Verification must beat not drafting by this much: step costs are measured, with noise.
const MARGIN: f64 = 1.02;

/// Drafted tokens to verify of each offer, for a step that already computes `base_tokens`
/// tokens and samples `base_samples` of them, with room for `room` more; each drafted token
/// costs `draft_cost` on top of its verification (zero once the drafts exist).
pub fn choose(
    offers: &[Offer],
    base_tokens: usize,
    base_samples: usize,
    room: usize,
    costs: &StepCosts,
    draft_cost: f64,
) -> Vec<usize> {
    let mut values: Vec<(f64, usize)> = offers
        .iter()
        .enumerate()
        .flat_map(|(i, o)| {
            let (f, c) = (o.first.clamp(0.0, 1.0), o.then.clamp(0.0, 1.0));
            (0..o.len).map(move |j| (f * c.powi(j as i32), i))
        })
        .collect();
    // Most valuable first; a draft's own tokens keep their order (stable sort), so every
    // chosen set is a prefix of each draft.
    values.sort_by(|a, b| b.0.total_cmp(&a.0));
    values.truncate(room);
    let rate = |tokens: f64, extra: usize| {
        tokens / (costs.cost(base_tokens + extra) + draft_cost * extra as f64)
    };
    let plain = rate(base_samples as f64, 0);
    let (mut best, mut best_rate) = (0, plain * MARGIN);
    let mut expected = base_samples as f64;
    for (n, &(value, _)) in values.iter().enumerate() {
        expected += value;
        let r = rate(expected, n + 1);
        if r > best_rate {
            (best, best_rate) = (n + 1, r);
        }
    }
    let mut counts = vec![0; offers.len()];
    for &(_, i) in &values[..best] {
        counts[i] += 1;
    }
    counts
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The AMD EPYC (AVX2) figures the issue quotes: 2 tokens 1.4, 4 tokens 2.1, 6 tokens 3.3.
    fn amd() -> StepCosts {
        StepCosts::from_points(vec![(1, 1.0), (2, 1.4), (4, 2.1), (6, 3.3), (8, 4.4)]).unwrap()
    }

    /// Kernels that verify 8 tokens for little more than one, then grow linearly.
    fn wide() -> StepCosts {
        StepCosts::from_points(vec![(1, 1.0), (8, 1.2), (16, 2.4), (64, 9.6)]).unwrap()
    }

    #[test]
    fn costs_interpolate_extend_and_never_fall() {
        let c = StepCosts::from_points(vec![(4, 6.0), (1, 2.0), (2, 2.8), (3, 2.6)]).unwrap();
        assert_eq!(c.cost(1), 1.0);
        assert_eq!(c.cost(2), 1.4);
        assert_eq!(c.cost(3), 1.4, "noise below a smaller step is raised to it");
        assert_eq!(c.cost(4), 3.0);
        assert!(
            (c.cost(6) - 6.2).abs() < 1e-9,
            "past the last point at the last slope"
        );
        assert!((wide().cost(40) - 6.0).abs() < 1e-9);
        assert!(StepCosts::from_points(vec![]).is_err());
        assert!(StepCosts::from_points(vec![(1, 0.0)]).is_err());
        assert!(StepCosts::from_points(vec![(1, f64::NAN)]).is_err());
    }

    #[test]
    fn a_draft_is_verified_only_where_it_pays() {
        let sure = geometric(0.9, 8);
        let doubtful = geometric(0.3, 8);
        // Wide kernels at batch 1: a likely draft is verified in full.
        assert_eq!(choose(&[sure], 1, 1, 100, &wide(), 0.0), vec![7]);
        // On AMD's costs a 2-token step costs 1.4 steps: an unlikely draft is not worth it.
        assert_eq!(choose(&[doubtful], 1, 1, 100, &amd(), 0.0), vec![0]);
        assert!(choose(&[sure], 1, 1, 100, &amd(), 0.0)[0] > 0);
        // Linear costs: never.
        assert_eq!(
            choose(&[sure], 1, 1, 100, &StepCosts::linear(), 0.0),
            vec![0]
        );
        // The budget bounds it.
        assert_eq!(choose(&[sure], 1, 1, 3, &wide(), 0.0), vec![3]);
        // A batch that already fills the kernels gains nothing from a draft that may fail.
        assert_eq!(choose(&[sure], 64, 64, 100, &wide(), 0.0), vec![0]);
    }

    #[test]
    fn a_costly_drafter_drafts_shorter_or_not_at_all() {
        let sure = geometric(0.8, 8);
        let free = choose(&[sure], 1, 1, 100, &wide(), 0.0)[0];
        let cheap = choose(&[sure], 1, 1, 100, &wide(), 0.1)[0];
        assert!(0 < cheap && cheap < free, "{cheap} {free}");
        // A draft model as costly as the target never pays at this acceptance.
        assert_eq!(choose(&[sure], 1, 1, 100, &wide(), 1.0), vec![0]);
    }

    #[test]
    fn the_surer_request_drafts_more() {
        let offers = [geometric(0.95, 6), geometric(0.5, 6)];
        let counts = choose(&offers, 2, 2, 100, &wide(), 0.0);
        assert!(counts[0] > counts[1], "{counts:?}");
    }

    /// Every token kept with the same chance.
    fn geometric(acceptance: f64, len: usize) -> Offer {
        Offer {
            first: acceptance,
            then: acceptance,
            len,
        }
    }

    #[test]
    fn a_draft_kept_in_runs_is_verified_further_than_its_first_token_alone_would_say() {
        // On AMD's costs a draft whose first token is kept less than half the time: one token
        // at most if every token is as doubtful; several if kept in runs once started.
        let toss = geometric(0.45, 8);
        let runs = Offer { then: 0.97, ..toss };
        assert_eq!(choose(&[toss], 1, 1, 100, &amd(), 0.0), vec![1]);
        assert_eq!(choose(&[runs], 1, 1, 100, &amd(), 0.0), vec![3]);
    }

    #[test]
    fn acceptance_follows_what_it_sees_and_forgets_slowly() {
        let mut a = Acceptance::default();
        assert_eq!(a.first.rate(0.5, 2.0), 0.5, "the prior before anything");
        for _ in 0..100 {
            a.record(4, 4);
        }
        assert!(a.first.rate(0.5, 2.0) > 0.97 && a.then.rate(0.5, 2.0) > 0.99);
        for _ in 0..1_000 {
            a.record(4, 0);
        }
        assert!(a.first.rate(0.5, 2.0) < 0.1, "{:?}", a);
        assert!(
            a.then.rate(0.5, 2.0) > 0.99,
            "nothing seen after a first miss"
        );
        // Half the drafts kept for 1 token of 4, half for all 4: every first token kept; of
        // the later ones, 3 kept in one half, one missed in the other.
        let mut runs = Acceptance::default();
        for _ in 0..100 {
            runs.record(4, 1);
            runs.record(4, 4);
        }
        assert!(runs.first.rate(0.5, 2.0) > 0.99, "{runs:?}");
        assert!((runs.then.rate(0.5, 0.0) - 0.75).abs() < 0.01, "{runs:?}");
    }

    proptest! {
        #[test]
        fn choices_are_within_each_draft_and_the_room(
            offers in prop::collection::vec((0.0f64..=1.0, 0.0f64..=1.0, 0usize..=16), 0..12),
            base in 1usize..80,
            room in 0usize..64,
        ) {
            let offers: Vec<Offer> =
                offers.iter().map(|&(first, then, len)| Offer { first, then, len }).collect();
            let counts = choose(&offers, base, base, room, &wide(), 0.0);
            prop_assert_eq!(counts.len(), offers.len());
            prop_assert!(counts.iter().sum::<usize>() <= room);
            for (c, o) in counts.iter().zip(&offers) {
                prop_assert!(*c <= o.len);
            }
        }
    }
}
