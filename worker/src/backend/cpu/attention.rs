//! One query head attending over its request's cached positions, with llama.cpp's arithmetic
//! (non-flash path, AVX2 build): scores `q·k` and outputs `Σ p·v` are f16 dot products
//! (the query and the weights rounded to f16) summed in 8 lanes with fused multiply-adds —
//! one accumulator per lane for a prompt (tinyBLAS), four for a single token
//! (`ggml_vec_dot_f16`) — and the softmax of `ggml_math`. Lanes follow the position in the
//! KV window, so a position's rounding does not depend on what else is in the batch.

use super::dot::Isa;
use super::ggml_math;
use crate::backend::BatchSlice;
use half::f16;

/// Which of llama.cpp's f16 dot products a slice's tokens get.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SumOrder {
    /// Several tokens of one sequence at once (llama.cpp's batched path).
    Prompt,
    /// One token (llama.cpp's vector dot product).
    Decode,
}

impl SumOrder {
    /// Prompt tokens (however the scheduler chunks them) sum as llama.cpp's prompt batch does,
    /// output tokens and one-token prompts as its single-token path does.
    pub fn for_slice(slice: &BatchSlice<'_>) -> SumOrder {
        let prompt_len = slice.tokens.len() - slice.num_output_tokens;
        if prompt_len >= 2 && slice.start < prompt_len {
            SumOrder::Prompt
        } else {
            SumOrder::Decode
        }
    }

    /// Accumulator vectors of 8 lanes.
    fn chunks(self) -> usize {
        match self {
            SumOrder::Prompt => 1,
            SumOrder::Decode => 4,
        }
    }
}

/// Floats of lane scratch `attend` needs for heads of `head_dim`.
pub fn lanes_len(head_dim: usize) -> usize {
    head_dim * 32
}

/// What one head reads: the layer's caches, the offsets of the positions it sees (in order),
/// and where its KV head starts within a cached vector.
pub struct HeadInputs<'a> {
    pub k_cache: &'a [f32],
    pub v_cache: &'a [f32],
    pub offsets: &'a [usize],
    pub kv_head: usize,
    pub scale: f32,
    pub order: SumOrder,
}

/// Writes the head's output for query `q` (already rounded to f16) into `out`.
#[allow(unsafe_code)]
pub fn attend(
    isa: Isa,
    inputs: &HeadInputs<'_>,
    q: &[f32],
    scores: &mut [f32],
    lanes: &mut [f32],
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx2_fma() {
        // SAFETY: every kernel set but `Portable` is only chosen when the CPU has AVX2 and FMA.
        unsafe { attend_fma(inputs, q, scores, lanes, out) };
        return;
    }
    let _ = isa;
    attend_impl(inputs, q, scores, lanes, out);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(unsafe_code)]
unsafe fn attend_fma(
    inputs: &HeadInputs<'_>,
    q: &[f32],
    scores: &mut [f32],
    lanes: &mut [f32],
    out: &mut [f32],
) {
    // Inlined here, `mul_add` becomes one instruction instead of a libm call.
    attend_impl(inputs, q, scores, lanes, out);
}

#[inline(always)]
fn attend_impl(
    inputs: &HeadInputs<'_>,
    q: &[f32],
    scores: &mut [f32],
    lanes: &mut [f32],
    out: &mut [f32],
) {
    let hd = q.len();
    let order = inputs.order;
    let mut max = f32::NEG_INFINITY;
    for (sc, &off) in scores.iter_mut().zip(inputs.offsets) {
        let base = off + inputs.kv_head;
        let k = &inputs.k_cache[base..base + hd];
        *sc = dot(order, q, k) * inputs.scale;
        max = max.max(*sc);
    }
    let scores = &mut scores[..inputs.offsets.len()];
    let inv = (1.0 / ggml_math::exp_and_sum(scores, max)) as f32;
    // out[d] = Σ_pos p[pos] · v[pos][d], position `pos` in lane pos % 8 of chunk (pos / 8) % n.
    // Lanes are stored slot-major (`lanes[slot * hd + d]`) so each position's update is one
    // contiguous run of fused multiply-adds.
    let chunks = order.chunks();
    let lanes = &mut lanes[..hd * 8 * chunks];
    lanes.fill(0.0);
    for (pos, (&w, &off)) in scores.iter().zip(inputs.offsets).enumerate() {
        let p = f16::from_f32(w * inv).to_f32();
        let slot = (pos / 8 % chunks) * 8 + pos % 8;
        let base = off + inputs.kv_head;
        let acc = &mut lanes[slot * hd..(slot + 1) * hd];
        for (a, &v) in acc.iter_mut().zip(&inputs.v_cache[base..base + hd]) {
            *a = p.mul_add(v, *a);
        }
    }
    // The same reduction as `reduce`, done a whole slot row (every d) at a time.
    let row = |slot: usize| &lanes[slot * hd..(slot + 1) * hd];
    match order {
        SumOrder::Prompt => {
            for (d, o) in out.iter_mut().enumerate() {
                let h = |i: usize| row(i)[d] + row(i + 4)[d];
                *o = (h(0) + h(2)) + (h(1) + h(3));
            }
        }
        SumOrder::Decode => {
            for (d, o) in out.iter_mut().enumerate() {
                let x = |i: usize| (row(i)[d] + row(16 + i)[d]) + (row(8 + i)[d] + row(24 + i)[d]);
                let t = |j: usize| x(j) + x(j + 4);
                *o = (t(0) + t(1)) + (t(2) + t(3));
            }
        }
    }
}

/// `a · b` in llama.cpp's order for `order` (lengths a multiple of 8 for `Prompt`; any other
/// length sums as `Decode` does, as llama.cpp falls back to its vector dot product).
#[inline(always)]
fn dot(order: SumOrder, a: &[f32], b: &[f32]) -> f32 {
    let order = if a.len().is_multiple_of(8) {
        order
    } else {
        SumOrder::Decode
    };
    let whole = match order {
        SumOrder::Prompt => a.len(),
        SumOrder::Decode => a.len() / 32 * 32,
    };
    // Lane j of chunk k at acc[k * 8 + j]: one chunk cycles for Prompt, four for Decode.
    let mut acc = [0.0f32; 32];
    let step = order.chunks() * 8;
    for (xs, ys) in a[..whole].chunks_exact(step).zip(b.chunks_exact(step)) {
        for ((s, &x), &y) in acc.iter_mut().zip(xs).zip(ys) {
            *s = x.mul_add(y, *s);
        }
    }
    let mut sum = reduce(order, &acc);
    if whole < a.len() {
        // ggml_vec_dot_f16's leftovers: f32 products summed in f64.
        let mut wide = f64::from(sum);
        for (&x, &y) in a[whole..].iter().zip(&b[whole..]) {
            wide += f64::from(x * y);
        }
        sum = wide as f32;
    }
    sum
}

/// Sums 32 lane accumulators the way the matching llama.cpp kernel does.
#[inline(always)]
fn reduce(order: SumOrder, acc: &[f32]) -> f32 {
    match order {
        // tinyBLAS's `hsum`.
        SumOrder::Prompt => ggml_math::hsum8(&acc[..8]),
        // GGML_F32x8_REDUCE: chunk 0+2 and 1+3, then those two, then halves and two hadds.
        SumOrder::Decode => {
            let mut x = [0.0f32; 8];
            for (i, v) in x.iter_mut().enumerate() {
                *v = (acc[i] + acc[16 + i]) + (acc[8 + i] + acc[24 + i]);
            }
            let t = [x[0] + x[4], x[1] + x[5], x[2] + x[6], x[3] + x[7]];
            (t[0] + t[1]) + (t[2] + t[3])
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_orders_sum_to_the_dot_product() {
        let a: Vec<f32> = (0..72).map(|i| (i as f32 * 0.3).sin()).collect();
        let b: Vec<f32> = (0..72).map(|i| (i as f32 * 0.7).cos()).collect();
        for order in [SumOrder::Prompt, SumOrder::Decode] {
            for n in [8, 64, 70, 72] {
                let exact: f64 = a[..n]
                    .iter()
                    .zip(&b)
                    .map(|(x, y)| f64::from(*x) * f64::from(*y))
                    .sum();
                assert!((f64::from(dot(order, &a[..n], &b[..n])) - exact).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn attention_weights_the_values_by_softmax() {
        // Two positions, head dim 8: equal keys give equal weights, so the output is the mean.
        let k_cache = vec![1.0f32; 16];
        let v_cache: Vec<f32> = (0..16).map(|i| if i < 8 { 1.0 } else { 3.0 }).collect();
        let inputs = HeadInputs {
            k_cache: &k_cache,
            v_cache: &v_cache,
            offsets: &[0, 8],
            kv_head: 0,
            scale: 0.5,
            order: SumOrder::Decode,
        };
        let (mut scores, mut lanes, mut out) =
            (vec![0.0; 2], vec![0.0; lanes_len(8)], vec![0.0; 8]);
        attend(
            Isa::detect(),
            &inputs,
            &[0.5; 8],
            &mut scores,
            &mut lanes,
            &mut out,
        );
        assert!(out.iter().all(|&o| (o - 2.0).abs() < 1e-3), "{out:?}");
    }
}
