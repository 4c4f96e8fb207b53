//! Softmax, SiLU and RoPE's rotation computed exactly as llama.cpp's CPU backend computes them
//! (AVX2 build): its vectorised `expf` (`ggml_v_expf`, a degree-5 polynomial after range
//! reduction), its summation order, and plain `expf` for the tail that does not fill 8 lanes. This model
//! amplifies last-bit differences (8-bit activation codes flip), so agreeing with llama.cpp
//! token for token needs the same roundings, not merely accurate ones.

use super::dot::Isa;

/// One lane of `ggml_v_expf` (ggml-cpu/vec.h): fused multiply-adds where it has them. Inlined
/// into callers compiled for FMA, `mul_add` is one instruction.
#[inline(always)]
pub fn ggml_expf(x: f32) -> f32 {
    let r = f32::from_bits(0x4B40_0000); // 0x1.8p23
    let z = x.mul_add(f32::from_bits(0x3FB8_AA3B), r); // log2(e)
    let n = z - r;
    let b = (-n).mul_add(
        f32::from_bits(0x35BF_BE8E),                  // 0x1.7f7d1cp-20
        (-n).mul_add(f32::from_bits(0x3F31_7200), x), // 0x1.62e4p-1
    );
    let e = z.to_bits() << 23;
    let k = f32::from_bits(e.wrapping_add(1.0f32.to_bits()));
    let u = b * b;
    let j = f32::from_bits(0x3C07_2010) // 0x1.0e4020p-7
        .mul_add(b, f32::from_bits(0x3D2B_9F17)) // 0x1.573e2ep-5
        .mul_add(
            u,
            f32::from_bits(0x3E2A_AF33).mul_add(b, f32::from_bits(0x3EFF_FEDB)), // 0x1.555e66p-3, 0x1.fffdb6p-2
        )
        .mul_add(u, f32::from_bits(0x3F7F_FFF6) * b); // 0x1.ffffecp-1
    if n.abs() <= 126.0 {
        return j.mul_add(k, k);
    }
    // Outside the normal range: scale in two steps (or saturate past 192).
    let g: u32 = if n <= 0.0 { 0x8200_0000 } else { 0 };
    let s1 = f32::from_bits(g.wrapping_add(0x7F00_0000));
    if n.abs() > 192.0 {
        return s1 * s1;
    }
    let s2 = f32::from_bits(e.wrapping_sub(g));
    s2.mul_add(j, s2) * s1
}

/// Sums 8 lanes as ggml's `hsum_float_8` (and tinyBLAS's `hsum`) does: halves, then pairs,
/// then the last two.
#[inline(always)]
pub fn hsum8(v: &[f32]) -> f32 {
    let h = [v[0] + v[4], v[1] + v[5], v[2] + v[6], v[3] + v[7]];
    (h[0] + h[2]) + (h[1] + h[3])
}

/// `ggml_vec_soft_max_f32` over one attention row: `x[i] = exp(x[i] - max)` in place; returns
/// the sum. llama.cpp's rows span the whole KV window (a multiple of 8 positions, the unseen
/// ones masked to exp(-inf) = 0), so every position goes through the vector `expf` and a
/// last partial block sums as if padded with zeros.
#[inline(always)]
pub fn exp_and_sum(x: &mut [f32], max: f32) -> f64 {
    let mut sum = 0.0f64;
    for chunk in x.chunks_mut(8) {
        let mut lanes = [0.0f32; 8];
        for (v, lane) in chunk.iter_mut().zip(lanes.iter_mut()) {
            *v = ggml_expf(*v - max);
            *lane = *v;
        }
        sum += f64::from(hsum8(&lanes));
    }
    sum
}

/// RoPE on one head: interleaved pairs (x[2i], x[2i+1]), the GGUF row layout (see
/// weights.rs), rotated by `(cos, sin)` with fused multiply-adds, as GCC compiles llama.cpp's
/// `x0*cos - x1*sin` and `x0*sin + x1*cos`.
#[allow(unsafe_code)]
pub fn rope(isa: Isa, head: &mut [f32], angles: &[(f32, f32)]) {
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx2_fma() {
        // SAFETY: every kernel set but `Portable` is only chosen when the CPU has AVX2 and FMA.
        unsafe { rope_fma(head, angles) };
        return;
    }
    let _ = isa;
    rope_impl(head, angles);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(unsafe_code)]
unsafe fn rope_fma(head: &mut [f32], angles: &[(f32, f32)]) {
    rope_impl(head, angles);
}

#[inline(always)]
fn rope_impl(head: &mut [f32], angles: &[(f32, f32)]) {
    for (pair, &(cos, sin)) in head.chunks_exact_mut(2).zip(angles) {
        let (a, b) = (pair[0], pair[1]);
        pair[0] = a.mul_add(cos, -(b * sin));
        pair[1] = a.mul_add(sin, b * cos);
    }
}

/// `ggml_vec_swiglu_f32`: `gate[i] = silu(gate[i]) * up[i]`.
#[allow(unsafe_code)]
pub fn swiglu(isa: Isa, gate: &mut [f32], up: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx2_fma() {
        // SAFETY: every kernel set but `Portable` is only chosen when the CPU has AVX2 and FMA.
        unsafe { swiglu_fma(gate, up) };
        return;
    }
    let _ = isa;
    swiglu_impl(gate, up);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(unsafe_code)]
unsafe fn swiglu_fma(gate: &mut [f32], up: &[f32]) {
    swiglu_impl(gate, up);
}

#[inline(always)]
fn swiglu_impl(gate: &mut [f32], up: &[f32]) {
    let whole = gate.len() / 8 * 8;
    for (g, u) in gate[..whole].iter_mut().zip(up) {
        *g = *g / (1.0 + ggml_expf(0.0 - *g)) * u;
    }
    for (g, u) in gate[whole..].iter_mut().zip(&up[whole..]) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ggml_expf_is_accurate_across_the_range() {
        for i in -2000..=2000 {
            let x = i as f32 * 0.05;
            let (ours, libm) = (ggml_expf(x), x.exp());
            if libm.is_infinite() {
                assert!(ours.is_infinite(), "exp({x}) = {ours}");
                continue;
            }
            assert!(
                (ours - libm).abs() <= libm * 4e-7 + f32::MIN_POSITIVE,
                "exp({x}): {ours} vs {libm}"
            );
        }
        assert_eq!(ggml_expf(-200.0), 0.0);
        assert_eq!(ggml_expf(f32::NEG_INFINITY), 0.0);
        assert!(ggml_expf(200.0).is_infinite());
    }

    #[test]
    fn softmax_sums_what_it_writes() {
        let mut x: Vec<f32> = (0..21).map(|i| (i as f32 * 0.7).sin() * 5.0).collect();
        let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum = exp_and_sum(&mut x, max);
        let direct: f64 = x.iter().map(|&v| f64::from(v)).sum();
        assert!((sum - direct).abs() < 1e-5);
    }
}
