//! Plain Rust dot products (any CPU), bit-identical to the AVX2 kernels and to llama.cpp's
//! AVX2 build: per block, 8 lanes of 4 integer products each (integer sums are exact in any
//! order), scaled into 8 float accumulators with fused multiply-adds, then summed in
//! `hsum_float_8`'s order.

use super::super::ggml_math::hsum8;
use super::super::quant::{Q8Row, QK};
use super::QuantRow;

/// Accumulates one block: lane k gets `scale * Σ_{j in 4k..4k+4} w[j] * a[j]`.
fn accumulate(acc: &mut [f32; 8], w: impl Fn(usize) -> i32, a: &[i8], scale: f32) {
    for (k, lane) in acc.iter_mut().enumerate() {
        let sum: i32 = (4 * k..4 * k + 4).map(|j| w(j) * i32::from(a[j])).sum();
        *lane = (sum as f32).mul_add(scale, *lane);
    }
}

pub fn q4_1_q8_1(w: QuantRow<'_>, act: &Q8Row) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut offsets = 0.0f32;
    for (b, block) in w.blocks.chunks_exact(20).enumerate() {
        let qs = &block[4..20];
        // Weight j < 16 is the low nibble of byte j, weight j >= 16 the high nibble of j - 16.
        let nibble = |j: usize| {
            i32::from(if j < 16 {
                qs[j] & 0x0F
            } else {
                qs[j - 16] >> 4
            })
        };
        accumulate(
            &mut acc,
            nibble,
            &act.q[b * QK..(b + 1) * QK],
            w.d[b] * act.d[b],
        );
        offsets = w.m[b].mul_add(act.s[b], offsets);
    }
    hsum8(&acc) + offsets
}

pub fn q4_0_q8_0(w: QuantRow<'_>, act: &Q8Row) -> f32 {
    let mut acc = [0.0f32; 8];
    for (b, block) in w.blocks.chunks_exact(18).enumerate() {
        let qs = &block[2..18];
        let nibble = |j: usize| {
            i32::from(if j < 16 {
                qs[j] & 0x0F
            } else {
                qs[j - 16] >> 4
            }) - 8
        };
        accumulate(
            &mut acc,
            nibble,
            &act.q[b * QK..(b + 1) * QK],
            w.d[b] * act.d[b],
        );
    }
    hsum8(&acc)
}

pub fn q8_0_q8_0(w: QuantRow<'_>, act: &Q8Row) -> f32 {
    let mut acc = [0.0f32; 8];
    for (b, block) in w.blocks.chunks_exact(34).enumerate() {
        let qs = &block[2..34];
        let byte = |j: usize| i32::from(qs[j] as i8);
        accumulate(
            &mut acc,
            byte,
            &act.q[b * QK..(b + 1) * QK],
            w.d[b] * act.d[b],
        );
    }
    hsum8(&acc)
}
