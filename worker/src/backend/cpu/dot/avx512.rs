//! AVX-512 tile kernels: a few weight rows against a group of eight tokens (`Group8`), two
//! tokens per 512-bit register. Each 256-bit half carries one token through exactly the
//! operations of the AVX2 kernels (same lanes, same integer sums, same f32 roundings, same
//! final reduction), so results stay bit-identical to them and to llama.cpp's AVX2 order,
//! while the scale, conversion and accumulation steps run once for two tokens.
//! Only reached after `Isa::detect` found AVX-512 F, BW, VL and VNNI on this CPU.
#![allow(unsafe_code)]

use super::super::acts::{Group8, GROUP};
use super::super::quant::{WeightType, QK};
use super::avx2::{hsum, rows_cover, tiled_layout};
use super::QuantRow;
use std::arch::x86_64::*;

/// Token pairs per group.
const PAIRS: usize = GROUP / 2;

/// `out[r][t] = rows[r] · token t of group` for Q4_1 or Q8_0 rows (`false` for other kinds,
/// or when a length does not cover the row's blocks).
pub fn tile8<const R: usize>(
    kind: WeightType,
    rows: &[QuantRow<'_>; R],
    group: &Group8,
    out: &mut [[f32; GROUP]; R],
) -> bool {
    let Some((size, q4)) = tiled_layout(kind) else {
        return false;
    };
    let blocks = rows[0].blocks.len() / size;
    let fit = group.blocks() >= blocks
        && group.q.len() >= blocks * GROUP * QK
        && group.d.len() >= blocks * GROUP * 8
        && rows_cover(rows, blocks, size, q4);
    if !fit {
        return false;
    }
    // SAFETY: the caller's Isa has AVX-512 F/BW/VL/VNNI, AVX2 and FMA; `fit` bounds every
    // load below by `blocks`.
    unsafe {
        if q4 {
            q4_1_tile8(rows, group, blocks, out);
        } else {
            q8_0_tile8(rows, group, blocks, out);
        }
    }
    true
}

/// Splits two tokens' accumulators and adds each half the way `avx2::hsum` does.
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn hsum_pair(v: __m512) -> [f32; 2] {
    let high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    [hsum(_mm512_castps512_ps256(v)), hsum(high)]
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
unsafe fn q4_1_tile8<const R: usize>(
    rows: &[QuantRow<'_>; R],
    group: &Group8,
    blocks: usize,
    out: &mut [[f32; GROUP]; R],
) {
    let low = _mm_set1_epi8(0x0F);
    let zero = _mm512_setzero_si512();
    let mut acc = [[_mm512_setzero_ps(); PAIRS]; R];
    let mut offsets = [_mm256_setzero_ps(); R];
    for b in 0..blocks {
        let q = group.q.as_ptr().add(b * GROUP * QK);
        let d = group.d.as_ptr().add(b * GROUP * 8);
        let s = _mm256_loadu_ps(group.s.as_ptr().add(b * GROUP));
        for r in 0..R {
            let w = &rows[r];
            let qs = _mm_loadu_si128(w.blocks.as_ptr().add(b * 20 + 4).cast());
            let wq = _mm256_set_m128i(
                _mm_and_si128(_mm_srli_epi16(qs, 4), low),
                _mm_and_si128(qs, low),
            );
            let wq = _mm512_broadcast_i64x4(wq);
            let wd = _mm512_set1_ps(*w.d.get_unchecked(b));
            // Lane t: fma(m, s_t, offset_t), the scalar chain of the AVX2 kernel.
            offsets[r] = _mm256_fmadd_ps(_mm256_set1_ps(*w.m.get_unchecked(b)), s, offsets[r]);
            for (p, acc) in acc[r].iter_mut().enumerate() {
                let a = _mm512_loadu_si512(q.add(p * 64).cast());
                let sums = _mm512_dpbusd_epi32(zero, wq, a);
                let scale = _mm512_mul_ps(wd, _mm512_loadu_ps(d.add(p * 16)));
                *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, *acc);
            }
        }
    }
    for r in 0..R {
        let mut offset = [0.0f32; GROUP];
        _mm256_storeu_ps(offset.as_mut_ptr(), offsets[r]);
        for p in 0..PAIRS {
            let [a, b] = hsum_pair(acc[r][p]);
            out[r][2 * p] = a + offset[2 * p];
            out[r][2 * p + 1] = b + offset[2 * p + 1];
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
unsafe fn q8_0_tile8<const R: usize>(
    rows: &[QuantRow<'_>; R],
    group: &Group8,
    blocks: usize,
    out: &mut [[f32; GROUP]; R],
) {
    let zero = _mm512_setzero_si512();
    let mut acc = [[_mm512_setzero_ps(); PAIRS]; R];
    for b in 0..blocks {
        let q = group.q.as_ptr().add(b * GROUP * QK);
        let d = group.d.as_ptr().add(b * GROUP * 8);
        for r in 0..R {
            let w = &rows[r];
            let wq = _mm256_loadu_si256(w.blocks.as_ptr().add(b * 34 + 2).cast());
            // |w| . (a with w's sign), as the AVX2 kernel; where w is 0 the product is 0
            // whatever sign `a` keeps.
            let abs_w = _mm512_broadcast_i64x4(_mm256_sign_epi8(wq, wq));
            let negative = _mm512_movepi8_mask(_mm512_broadcast_i64x4(wq));
            let wd = _mm512_set1_ps(*w.d.get_unchecked(b));
            for (p, acc) in acc[r].iter_mut().enumerate() {
                let a = _mm512_loadu_si512(q.add(p * 64).cast());
                let signed = _mm512_mask_sub_epi8(a, negative, zero, a);
                let sums = _mm512_dpbusd_epi32(zero, abs_w, signed);
                let scale = _mm512_mul_ps(wd, _mm512_loadu_ps(d.add(p * 16)));
                *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, *acc);
            }
        }
    }
    for r in 0..R {
        for p in 0..PAIRS {
            let [a, b] = hsum_pair(acc[r][p]);
            out[r][2 * p] = a;
            out[r][2 * p + 1] = b;
        }
    }
}
