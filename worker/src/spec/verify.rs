//! Exact verification of a draft against the target model. Greedy: the draft's tokens are
//! kept while they equal the target's argmax, then the target's own token follows. Sampling
//! (Leviathan et al., Chen et al.): a drafted token `x` is kept with probability
//! `min(1, p(x) / q(x))`; at the first rejection the next token is drawn from `max(0, p - q)`
//! normalised; when every drafted token is kept, a bonus token is drawn from the target's next
//! distribution. The emitted tokens are distributed exactly as the target's.
//!
//! A drafter without probabilities (prompt lookup, the suffix cache) is the point mass
//! `q(x) = 1`: keeping `x` with probability `p(x)` and otherwise drawing from `p` without `x`
//! is the same as drawing the target's token and keeping `x` if they are equal. Drawn with the
//! plain sampler's own draw for each output position, that makes a seeded request's output
//! the same with speculation as without, token for token.

use crate::request::SamplingParams;
use crate::sample::sample;

/// Verifies a deterministic draft (prompt lookup, the suffix cache) against the model's
/// logits at each drafted position and the next (`draft.len() + 1` rows), under the request's
/// sampling: each position's token is the one the plain sampler draws for that output
/// position (`position` is the first drafted one's), and the draft is kept while it agrees.
pub fn verify_logits(
    rows: &[&[f32]],
    draft: &[u32],
    params: &SamplingParams,
    seed: u64,
    position: usize,
) -> Verified {
    assert_eq!(rows.len(), draft.len() + 1, "one row per position");
    let mut tokens = Vec::with_capacity(rows.len());
    for (i, row) in rows.iter().enumerate() {
        let token = sample(row, params, seed, position + i);
        tokens.push(token);
        if draft.get(i) != Some(&token) {
            break;
        }
    }
    Verified {
        accepted: tokens.len() - 1,
        tokens,
    }
}

/// What a verification emits: the drafted tokens kept, then the target's own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    pub tokens: Vec<u32>,
    /// How many of `tokens` are the draft's (the rest, always one, is the target's).
    pub accepted: usize,
}

/// The draft's distribution at each drafted position.
#[derive(Debug, Clone, Copy)]
pub enum DraftProbs<'a> {
    /// A deterministic drafter: all its mass on the drafted token.
    PointMass,
    /// A draft model's distributions over the vocabulary, one per drafted token.
    Model(&'a [Vec<f64>]),
}

/// Sampled verification: `target` holds the target's distribution (after temperature, top-k
/// and top-p) at each drafted position and one more; `uniform` draws in [0, 1).
pub fn verify_sampled(
    draft: &[u32],
    draft_probs: DraftProbs<'_>,
    target: &[Vec<f64>],
    uniform: impl FnMut() -> f64,
) -> Verified {
    verify_with(draft, draft_probs, target, uniform, Residual::Normalised)
}

/// How the token after a rejection is drawn; only the normalised residual is exact (the other
/// is the bias the tests must catch).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Residual {
    Normalised,
    #[cfg(test)]
    Unnormalised,
}

fn verify_with(
    draft: &[u32],
    draft_probs: DraftProbs<'_>,
    target: &[Vec<f64>],
    mut uniform: impl FnMut() -> f64,
    residual: Residual,
) -> Verified {
    assert_eq!(
        target.len(),
        draft.len() + 1,
        "one target distribution per position"
    );
    let mut tokens = Vec::with_capacity(draft.len() + 1);
    for (i, &x) in draft.iter().enumerate() {
        let p = &target[i];
        let q_of = |t: u32| match draft_probs {
            DraftProbs::PointMass => {
                if t == x {
                    1.0
                } else {
                    0.0
                }
            }
            DraftProbs::Model(q) => q[i].get(t as usize).copied().unwrap_or(0.0),
        };
        let (px, qx) = (p.get(x as usize).copied().unwrap_or(0.0), q_of(x));
        if qx > 0.0 && uniform() < (px / qx).min(1.0) {
            tokens.push(x);
            continue;
        }
        let rest: Vec<f64> = (0..p.len())
            .map(|t| (p[t] - q_of(t as u32)).max(0.0))
            .collect();
        let accepted = tokens.len();
        let total = match residual {
            Residual::Normalised => rest.iter().sum(),
            #[cfg(test)]
            Residual::Unnormalised => 1.0,
        };
        // p == q leaves no residual; then p itself (it can only happen when px/qx == 1, which
        // always accepts, so only rounding gets here).
        let next = if total > 0.0 {
            draw(&rest, total, uniform())
        } else {
            draw(p, p.iter().sum(), uniform())
        };
        tokens.push(next);
        return Verified { tokens, accepted };
    }
    let bonus = &target[draft.len()];
    tokens.push(draw(bonus, bonus.iter().sum(), uniform()));
    Verified {
        accepted: draft.len(),
        tokens,
    }
}

/// The token at which the running mass of `weights` passes `u * total`.
fn draw(weights: &[f64], total: f64, u: f64) -> u32 {
    let mut left = u * total;
    for (t, &w) in weights.iter().enumerate() {
        left -= w;
        if left < 0.0 {
            return t as u32;
        }
    }
    // Rounding left a sliver: the last token with any mass.
    weights.iter().rposition(|&w| w > 0.0).unwrap_or(0) as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::distribution;

    /// SplitMix64 in [0, 1): a reproducible stream, so the statistics below cannot flake.
    fn stream(seed: u64) -> impl FnMut() -> f64 {
        let mut state = seed;
        move || {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            (z >> 11) as f64 / (1u64 << 53) as f64
        }
    }

    /// Logits whose argmax is each of `tokens` in turn.
    fn peaked(tokens: &[u32]) -> Vec<Vec<f32>> {
        tokens
            .iter()
            .map(|&t| (0..10).map(|i| if i == t { 5.0 } else { 0.0 }).collect())
            .collect()
    }

    fn greedy(draft: &[u32], target: &[u32]) -> Verified {
        let rows = peaked(target);
        let rows: Vec<&[f32]> = rows.iter().map(Vec::as_slice).collect();
        verify_logits(&rows, draft, &SamplingParams::default(), 0, 0)
    }

    #[test]
    fn greedy_keeps_the_matching_prefix_then_the_targets_token() {
        assert_eq!(
            greedy(&[5, 6, 7], &[5, 6, 9, 1]),
            Verified {
                tokens: vec![5, 6, 9],
                accepted: 2
            }
        );
        assert_eq!(greedy(&[5, 6], &[5, 6, 4]).tokens, vec![5, 6, 4], "bonus");
        assert_eq!(greedy(&[], &[3]).tokens, vec![3]);
        assert_eq!(greedy(&[8], &[2, 3]).tokens, vec![2]);
    }

    /// With a seed, each position's token is the plain sampler's for that output position,
    /// so speculation leaves a seeded request's output as it was.
    #[test]
    fn a_seeded_sampled_draft_emits_what_plain_sampling_would() {
        let params = SamplingParams {
            temperature: 1.0,
            top_p: 0.9,
            ..SamplingParams::default()
        };
        let rows: Vec<Vec<f32>> = (0..5)
            .map(|r| (0..8).map(|t| ((t * 7 + r * 3) % 5) as f32 * 0.4).collect())
            .collect();
        let rows: Vec<&[f32]> = rows.iter().map(Vec::as_slice).collect();
        for seed in 0..200u64 {
            let plain: Vec<u32> = (0..5)
                .map(|i| sample(rows[i], &params, seed, 10 + i))
                .collect();
            // The plain tokens as the draft: all kept, and the bonus is the plain fifth.
            assert_eq!(
                verify_logits(&rows, &plain[..4], &params, seed, 10).tokens,
                plain
            );
            // A wrong second token: the plain first two, whatever was drafted after.
            let mut wrong = plain[..4].to_vec();
            wrong[1] = (wrong[1] + 1) % 8;
            assert_eq!(
                verify_logits(&rows, &wrong, &params, seed, 10).tokens,
                plain[..2]
            );
        }
    }

    #[test]
    fn a_point_mass_draft_the_target_is_sure_of_is_always_kept() {
        let p = vec![vec![0.0, 1.0, 0.0], vec![0.0, 0.0, 1.0]];
        let mut u = stream(1);
        for _ in 0..100 {
            let v = verify_sampled(&[1], DraftProbs::PointMass, &p, &mut u);
            assert_eq!(v.tokens, vec![1, 2]);
        }
        // ...and one it gives no mass is never kept, the residual being p itself.
        let v = verify_sampled(&[0], DraftProbs::PointMass, &p, &mut u);
        assert_eq!(
            v,
            Verified {
                tokens: vec![1],
                accepted: 0
            }
        );
    }

    const P: [f64; 5] = [0.40, 0.25, 0.15, 0.12, 0.08];
    const Q: [f64; 5] = [0.10, 0.15, 0.30, 0.05, 0.40];

    /// Frequencies of the first emitted token over `n` drafts of one token from `Q`.
    fn first_tokens(n: usize, residual: Residual, seed: u64) -> [f64; 5] {
        let mut u = stream(seed);
        let target = vec![P.to_vec(), P.to_vec()];
        let q = vec![Q.to_vec()];
        let mut counts = [0.0; 5];
        for _ in 0..n {
            let x = draw(&Q, 1.0, u());
            let v = verify_with(&[x], DraftProbs::Model(&q), &target, &mut u, residual);
            counts[v.tokens[0] as usize] += 1.0;
        }
        counts
    }

    fn chi_squared(counts: &[f64; 5], expected: &[f64; 5]) -> f64 {
        let n: f64 = counts.iter().sum();
        counts
            .iter()
            .zip(expected)
            .map(|(c, e)| (c - n * e).powi(2) / (n * e))
            .sum()
    }

    fn total_variation(counts: &[f64; 5], to: &[f64; 5]) -> f64 {
        let n: f64 = counts.iter().sum();
        counts
            .iter()
            .zip(to)
            .map(|(c, p)| (c / n - p).abs())
            .sum::<f64>()
            / 2.0
    }

    /// χ² with 4 degrees of freedom exceeds this with probability 0.01.
    const CHI2_4_AT_001: f64 = 13.277;

    #[test]
    fn speculative_sampling_draws_from_the_target() {
        let counts = first_tokens(100_000, Residual::Normalised, 7);
        let chi2 = chi_squared(&counts, &P);
        assert!(chi2 < CHI2_4_AT_001, "chi2 {chi2}: {counts:?}");
        // The distance to the target falls with the draws; to the draft's, it does not.
        let (few, many) = (
            first_tokens(1_000, Residual::Normalised, 8),
            first_tokens(100_000, Residual::Normalised, 9),
        );
        assert!(total_variation(&many, &P) < total_variation(&few, &P));
        assert!(total_variation(&many, &P) < 0.01);
        assert!(total_variation(&many, &Q) > 0.3);
    }

    #[test]
    fn a_residual_left_unnormalised_is_caught() {
        let counts = first_tokens(100_000, Residual::Unnormalised, 7);
        let chi2 = chi_squared(&counts, &P);
        assert!(chi2 > CHI2_4_AT_001, "chi2 {chi2}: the bias went unseen");
    }

    #[test]
    fn a_drafted_token_under_temperature_and_top_k_comes_out_as_the_model_samples() {
        let logits = [1.0f32, 0.5, 0.0, -0.5, 2.0, -3.0];
        let params = SamplingParams {
            temperature: 0.7,
            top_k: 5,
            ..SamplingParams::default()
        };
        let p: Vec<f64> = {
            let mut p = vec![0.0; logits.len()];
            for (t, q) in distribution(&logits, &params) {
                p[t as usize] = q;
            }
            p
        };
        assert_eq!(p[5], 0.0, "top-k 5 drops the least likely");
        let rows: [&[f32]; 2] = [&logits, &logits];
        let mut counts = [0.0; 5];
        for seed in 0..100_000u64 {
            let v = verify_logits(&rows, &[2], &params, seed, 3);
            let first = v.tokens[0] as usize;
            assert!(first < 5, "a token top-k dropped came out");
            counts[first] += 1.0;
        }
        let expected: [f64; 5] = std::array::from_fn(|t| p[t]);
        let chi2 = chi_squared(&counts, &expected);
        assert!(
            chi2 < CHI2_4_AT_001,
            "chi2 {chi2}: {counts:?} against {expected:?}"
        );
        // Greedy is the argmax chain.
        let greedy = SamplingParams::default();
        assert_eq!(verify_logits(&rows, &[4], &greedy, 0, 0).tokens, vec![4, 4]);
        assert_eq!(verify_logits(&rows, &[1], &greedy, 0, 0).tokens, vec![4]);
    }

    #[test]
    fn every_kept_draft_earns_a_bonus_token() {
        let target = vec![vec![0.5, 0.5], vec![0.5, 0.5], vec![0.0, 1.0]];
        let q = vec![vec![0.5, 0.5], vec![0.5, 0.5]];
        let mut u = stream(3);
        for _ in 0..200 {
            // q == p: every drafted token is kept.
            let v = verify_sampled(&[0, 1], DraftProbs::Model(&q), &target, &mut u);
            assert_eq!(
                v,
                Verified {
                    tokens: vec![0, 1, 1],
                    accepted: 2
                }
            );
        }
    }
}
