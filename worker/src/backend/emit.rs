//! From a step's logits rows to its sampled tokens: one token per sampling slice, or with a
//! draft the draft's kept tokens and the model's next one. Shared by the backends that compute
//! real logits.

use super::{BatchSlice, Sampled};
use crate::sample::{distribution_of_best, draw, logprobs, sample};
use crate::spec::verify_logits;

/// `rows`: (slice index, logits row) for every row the step computed logits for, in batch and
/// row order (a drafted slice's `draft + 1` rows together).
pub fn emit<'r>(
    batch: &[BatchSlice<'_>],
    rows: impl Iterator<Item = (usize, &'r [f32])>,
) -> Vec<Sampled> {
    let mut rows = rows.peekable();
    let mut sampled = Vec::new();
    while let Some((i, first)) = rows.next() {
        let s = &batch[i];
        let seed = seed(s);
        let emit = |token: u32, row: &[f32]| Sampled {
            id: s.id,
            token,
            logprobs: s.params.logprobs.map(|n| logprobs(row, token, n as usize)),
        };
        if s.draft == 0 {
            // The common step: one row, one token, nothing to verify.
            sampled.push(emit(
                sample(first, s.params, seed, s.num_output_tokens),
                first,
            ));
            continue;
        }
        let mut slice_rows = vec![first];
        while let Some((_, row)) = rows.next_if(|(j, _)| *j == i) {
            slice_rows.push(row);
        }
        let end = s.start + s.len;
        let draft = &s.tokens[end + 1 - slice_rows.len()..end];
        let position = s.num_output_tokens.saturating_sub(s.draft);
        let verified = verify_logits(&slice_rows, draft, s.params, seed, position);
        sampled.extend(
            verified
                .tokens
                .iter()
                .zip(&slice_rows)
                .map(|(&token, row)| emit(token, row)),
        );
    }
    sampled
}

/// The token of a slice that samples with top-k (no draft, no log-probabilities), from only
/// its row's best `top_k` tokens as (id, logit) pairs: what [`emit`] picks from the whole row.
pub fn emit_from_best(s: &BatchSlice<'_>, best: &[(u32, f32)]) -> Sampled {
    let kept = distribution_of_best(best, s.params);
    Sampled {
        id: s.id,
        token: draw(&kept, seed(s), s.num_output_tokens),
        logprobs: None,
    }
}

/// Without a seed, the request id seeds the draws (different per request).
fn seed(s: &BatchSlice<'_>) -> u64 {
    s.params
        .seed
        .unwrap_or(s.id.wrapping_mul(0x2545_F491_4F6C_DD1D))
}
