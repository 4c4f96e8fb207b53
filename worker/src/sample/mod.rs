//! Choosing the next token from logits: greedy, or temperature with top-k and top-p, drawn from
//! a generator keyed by (seed, output position), so a request with a seed gets the same output
//! whatever else is in its batch.

use crate::request::SamplingParams;

/// The log-probability of the chosen token and of the most likely tokens, under the model's
/// raw distribution (before temperature, top-k and top-p), as vLLM reports them by default.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub logprob: f32,
    /// The `n` most likely tokens, best first.
    pub top: Vec<(u32, f32)>,
}

/// Log-softmax of `logits` at `token`, and the `n` most likely tokens.
pub fn logprobs(logits: &[f32], token: u32, n: usize) -> TokenLogprobs {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&v| f64::from(v - max).exp()).sum();
    let log_norm = f64::from(max) + sum.ln();
    let logprob_of = |v: f32| (f64::from(v) - log_norm) as f32;
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(n);
    if n > 0 {
        let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
        let n = n.min(ids.len());
        let by_logit = |a: &u32, b: &u32| {
            logits[*b as usize]
                .total_cmp(&logits[*a as usize])
                .then(a.cmp(b))
        };
        if n < ids.len() {
            ids.select_nth_unstable_by(n - 1, by_logit);
            ids.truncate(n);
        }
        ids.sort_unstable_by(by_logit);
        top.extend(ids.iter().map(|&i| (i, logprob_of(logits[i as usize]))));
    }
    TokenLogprobs {
        logprob: logprob_of(logits[token as usize]),
        top,
    }
}

/// Below this temperature sampling is greedy.
const GREEDY_BELOW: f32 = 1e-5;

/// The index of the largest logit (the first of equals).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// A uniform draw in [0, 1) from (seed, position): SplitMix64.
pub(crate) fn uniform(seed: u64, position: usize) -> f64 {
    let mut z = seed ^ (position as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

/// Whether these parameters always pick the argmax.
pub fn is_greedy(params: &SamplingParams) -> bool {
    params.temperature < GREEDY_BELOW || params.top_k == 1
}

/// Picks a token for output position `position` of a request.
pub fn sample(logits: &[f32], params: &SamplingParams, seed: u64, position: usize) -> u32 {
    if is_greedy(params) {
        return argmax(logits);
    }
    draw(&distribution(logits, params), seed, position)
}

/// The token `kept` (see [`distribution`]) gives for output position `position`.
pub fn draw(kept: &[(u32, f64)], seed: u64, position: usize) -> u32 {
    let mut draw = uniform(seed, position);
    for &(token, p) in kept {
        draw -= p;
        if draw < 0.0 {
            return token;
        }
    }
    kept.last().map_or(0, |k| k.0)
}

/// The tokens a sampled (not greedy) draw may pick and their probabilities after
/// temperature, top-k and top-p, summing to 1, most likely first (ties by id).
pub fn distribution(logits: &[f32], params: &SamplingParams) -> Vec<(u32, f64)> {
    let scaled = logits.iter().enumerate();
    kept(
        scaled
            .map(|(i, &v)| (i as u32, v / params.temperature))
            .collect(),
        params,
    )
}

/// [`distribution`] from only the row's best `top_k` tokens as (id, logit) pairs, in any
/// order (what a GPU picks out of the row): the same probabilities, bit for bit.
pub fn distribution_of_best(best: &[(u32, f32)], params: &SamplingParams) -> Vec<(u32, f64)> {
    let scaled = best.iter().map(|&(id, v)| (id, v / params.temperature));
    kept(scaled.collect(), params)
}

/// `candidates` (id, logit over temperature) cut to the best `top_k` (by value, then the
/// lower id: one answer whatever the selection algorithm) and then to the top-p nucleus.
fn kept(mut candidates: Vec<(u32, f32)>, params: &SamplingParams) -> Vec<(u32, f64)> {
    let best_first = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    let k = if params.top_k == 0 {
        candidates.len()
    } else {
        (params.top_k as usize).min(candidates.len())
    };
    if k == 0 {
        return Vec::new();
    }
    if k < candidates.len() {
        candidates.select_nth_unstable_by(k - 1, best_first);
        candidates.truncate(k);
    }
    candidates.sort_unstable_by(best_first);
    let max = candidates[0].1;
    let mut probs: Vec<(u32, f64)> = candidates
        .iter()
        .map(|&(token, v)| (token, f64::from(v - max).exp()))
        .collect();
    let total: f64 = probs.iter().map(|p| p.1).sum();
    // Top-p: the smallest prefix whose mass reaches p.
    if params.top_p < 1.0 {
        let mut mass = 0.0;
        if let Some(last) = probs.iter().position(|p| {
            mass += p.1 / total;
            mass >= f64::from(params.top_p)
        }) {
            probs.truncate(last + 1);
        }
    }
    let kept: f64 = probs.iter().map(|p| p.1).sum();
    probs.iter_mut().for_each(|p| p.1 /= kept);
    probs
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: u32, top_p: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            ..SamplingParams::default()
        }
    }

    #[test]
    fn logprobs_are_a_normalised_log_softmax() {
        let logits = [1.0f32, 3.0, 2.0, 3.0];
        let lp = logprobs(&logits, 2, 3);
        let total: f64 = logits.iter().map(|&v| f64::from(v).exp()).sum();
        assert!((f64::from(lp.logprob) - (2.0 - total.ln())).abs() < 1e-6);
        // Ties keep the lower id first; the list is best first and has n entries.
        let ids: Vec<u32> = lp.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, vec![1, 3, 2]);
        let mass: f64 = (0..4)
            .map(|t| f64::from(logprobs(&logits, t, 0).logprob).exp())
            .sum();
        assert!((mass - 1.0).abs() < 1e-6);
        assert_eq!(logprobs(&logits, 0, 10).top.len(), 4);
        assert!(logprobs(&logits, 0, 0).top.is_empty());
    }

    #[test]
    fn greedy_takes_the_first_maximum() {
        assert_eq!(sample(&[1.0, 3.0, 3.0, 2.0], &params(0.0, 0, 1.0), 1, 0), 1);
    }

    #[test]
    fn same_seed_same_draws_and_filters_hold() {
        let logits: Vec<f32> = (0..100).map(|i| (i as f32 * 0.37).sin() * 4.0).collect();
        let p = params(0.8, 0, 1.0);
        let a: Vec<u32> = (0..50).map(|pos| sample(&logits, &p, 42, pos)).collect();
        let b: Vec<u32> = (0..50).map(|pos| sample(&logits, &p, 42, pos)).collect();
        assert_eq!(a, b);
        let c: Vec<u32> = (0..50).map(|pos| sample(&logits, &p, 43, pos)).collect();
        assert_ne!(a, c);
        // top-k 3: only the three best ever come out.
        let mut best: Vec<u32> = (0..100).collect();
        best.sort_by(|x, y| logits[*y as usize].total_cmp(&logits[*x as usize]));
        for pos in 0..200 {
            assert!(best[..3].contains(&sample(&logits, &params(1.0, 3, 1.0), 7, pos)));
        }
        // top-p tiny: only the best.
        for pos in 0..50 {
            assert_eq!(sample(&logits, &params(1.0, 0, 1e-6), 7, pos), best[0]);
        }
    }

    /// The best `top_k` alone, in any order, give the whole row's distribution, bit for bit;
    /// ties at the cut keep the lower ids.
    #[test]
    fn the_best_k_alone_give_the_rows_distribution() {
        let mut logits: Vec<f32> = (0..500).map(|i| ((i * 7919) % 113) as f32 * 0.05).collect();
        logits[3] = 9.0;
        logits[400] = 9.0;
        for (t, k, p) in [
            (0.7, 5, 1.0),
            (1.3, 40, 0.9),
            (1.0, 113, 0.5),
            (0.9, 1000, 1.0),
        ] {
            let params = params(t, k, p);
            let whole = distribution(&logits, &params);
            let mut best: Vec<(u32, f32)> = (0..500u32).map(|i| (i, logits[i as usize])).collect();
            best.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            best.truncate(k as usize);
            best.reverse();
            assert_eq!(distribution_of_best(&best, &params), whole, "top_k {k}");
        }
        // 113 distinct values, each several times: the cut at 5 falls inside the tie of
        // 25, 138, 251, 364 and 477 (the largest value after the two 9s).
        let five: Vec<u32> = distribution(&logits, &params(1.0, 5, 1.0))
            .iter()
            .map(|p| p.0)
            .collect();
        assert_eq!(five, [3, 400, 25, 138, 251]);
    }
}
