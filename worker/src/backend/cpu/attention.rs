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
    attend_impl::<false>(inputs, q, scores, lanes, out);
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
    // Inlined here, `mul_add` becomes one instruction instead of a libm call, and the dot
    // products take the explicit 8-lane kernels.
    attend_impl::<true>(inputs, q, scores, lanes, out);
}

/// With `SIMD`, the caller has AVX2 and FMA (only `attend_fma` passes it).
#[inline(always)]
fn attend_impl<const SIMD: bool>(
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
        *sc = dot::<SIMD>(order, q, k) * inputs.scale;
        max = max.max(*sc);
    }
    let scores = &mut scores[..inputs.offsets.len()];
    let inv = (1.0 / ggml_math::exp_and_sum(scores, max)) as f32;
    // out[d] = Σ_pos p[pos] · v[pos][d], position `pos` in lane pos % 8 of chunk (pos / 8) % n.
    // Lanes are stored slot-major (`lanes[slot * hd + d]`) so each position's update is one
    // contiguous run of fused multiply-adds. Position `pos < slots` is its slot's first: it
    // starts the slot with `p·v + 0`, exactly what adding to a zeroed slot gives, so only
    // slots no position reaches are zeroed.
    let slots = order.chunks() * 8;
    let lanes = &mut lanes[..hd * slots];
    let n = scores.len();
    lanes[n.min(slots) * hd..].fill(0.0);
    for (pos, (&w, &off)) in scores.iter().zip(inputs.offsets).enumerate() {
        let p = f16::from_f32(w * inv).to_f32();
        let slot = pos % slots;
        let base = off + inputs.kv_head;
        let acc = &mut lanes[slot * hd..(slot + 1) * hd];
        let v = &inputs.v_cache[base..base + hd];
        if pos < slots {
            for (a, &v) in acc.iter_mut().zip(v) {
                *a = p.mul_add(v, 0.0);
            }
        } else {
            for (a, &v) in acc.iter_mut().zip(v) {
                *a = p.mul_add(v, *a);
            }
        }
    }
    // The same reduction as `dot`'s, a whole slot row (every d) at a time, in place.
    let mut add = |dst: usize, src: usize| {
        let (low, high) = lanes.split_at_mut(src * hd);
        for (a, b) in low[dst * hd..(dst + 1) * hd].iter_mut().zip(&high[..hd]) {
            *a += b;
        }
    };
    match order {
        SumOrder::Prompt => {
            // hsum8: h_i = l_i + l_{i+4}, then (h_0 + h_2) + (h_1 + h_3).
            (0..4).for_each(|i| add(i, i + 4));
            add(0, 2);
            add(1, 3);
            add(0, 1);
        }
        SumOrder::Decode => {
            // x_i = (c0_i + c2_i) + (c1_i + c3_i); t_j = x_j + x_{j+4};
            // (t_0 + t_1) + (t_2 + t_3).
            for i in 0..8 {
                add(i, 16 + i);
                add(8 + i, 24 + i);
                add(i, 8 + i);
            }
            (0..4).for_each(|j| add(j, j + 4));
            add(0, 1);
            add(2, 3);
            add(0, 2);
        }
    }
    out.copy_from_slice(&lanes[..hd]);
}

/// `a · b` in llama.cpp's order for `order` (lengths a multiple of 8 for `Prompt`; any other
/// length sums as `Decode` does, as llama.cpp falls back to its vector dot product).
#[inline(always)]
fn dot<const SIMD: bool>(order: SumOrder, a: &[f32], b: &[f32]) -> f32 {
    if order == SumOrder::Prompt && a.len().is_multiple_of(8) {
        // tinyBLAS: one 8-lane accumulator, then its `hsum`.
        let acc = lanes::<1, SIMD>(a, b);
        ggml_math::hsum8(&acc[0])
    } else {
        // ggml_vec_dot_f16: four 8-lane accumulators over 32 at a time, GGML_F32x8_REDUCE
        // (chunk 0+2 and 1+3, then those two, then halves and two hadds), then the
        // leftovers as f32 products summed in f64.
        let whole = a.len() / 32 * 32;
        let acc = lanes::<4, SIMD>(&a[..whole], &b[..whole]);
        let x: [f32; 8] =
            std::array::from_fn(|i| (acc[0][i] + acc[2][i]) + (acc[1][i] + acc[3][i]));
        let t = [x[0] + x[4], x[1] + x[5], x[2] + x[6], x[3] + x[7]];
        let mut sum = (t[0] + t[1]) + (t[2] + t[3]);
        if whole < a.len() {
            let mut wide = f64::from(sum);
            for (&x, &y) in a[whole..].iter().zip(&b[whole..]) {
                wide += f64::from(x * y);
            }
            sum = wide as f32;
        }
        sum
    }
}

/// `C` accumulators of 8 lanes, element `i` of `a · b` fused into lane `i % 8` of accumulator
/// `(i / 8) % C` (`a.len()` a multiple of `8 * C`). Fixed-size, so they stay in registers;
/// with `SIMD` (AVX2 and FMA present), one 256-bit register each.
#[inline(always)]
fn lanes<const C: usize, const SIMD: bool>(a: &[f32], b: &[f32]) -> [[f32; 8]; C] {
    #[cfg(target_arch = "x86_64")]
    if SIMD {
        return fma_lanes::<C>(a, b);
    }
    let mut acc = [[0.0f32; 8]; C];
    for (xs, ys) in a.chunks_exact(8 * C).zip(b.chunks_exact(8 * C)) {
        for (k, acc) in acc.iter_mut().enumerate() {
            for (j, s) in acc.iter_mut().enumerate() {
                *s = xs[k * 8 + j].mul_add(ys[k * 8 + j], *s);
            }
        }
    }
    acc
}

/// `lanes` with AVX2 registers: the same fused multiply-add per lane, in the same order.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(unsafe_code)]
fn fma_lanes<const C: usize>(a: &[f32], b: &[f32]) -> [[f32; 8]; C] {
    use std::arch::x86_64::*;
    let n = a.len().min(b.len()) / (8 * C) * (8 * C);
    let mut out = [[0.0f32; 8]; C];
    // SAFETY: reached only through `attend_fma` (AVX2 and FMA present); every load reads
    // `a[i..i + 8]` or `b[i..i + 8]` with `i + 8 <= n`, inside both slices.
    unsafe {
        let mut acc = [_mm256_setzero_ps(); C];
        let mut i = 0;
        while i < n {
            for (k, acc) in acc.iter_mut().enumerate() {
                let x = _mm256_loadu_ps(a.as_ptr().add(i + 8 * k));
                let y = _mm256_loadu_ps(b.as_ptr().add(i + 8 * k));
                *acc = _mm256_fmadd_ps(x, y, *acc);
            }
            i += 8 * C;
        }
        for (o, acc) in out.iter_mut().zip(acc) {
            _mm256_storeu_ps(o.as_mut_ptr(), acc);
        }
    }
    out
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
                let scalar = dot::<false>(order, &a[..n], &b[..n]);
                assert!((f64::from(scalar) - exact).abs() < 1e-5);
                if Isa::detect().has_avx2_fma() {
                    let simd = dot::<true>(order, &a[..n], &b[..n]);
                    assert_eq!(simd.to_bits(), scalar.to_bits(), "{order:?} {n}");
                }
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
