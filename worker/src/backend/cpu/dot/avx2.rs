//! AVX2 + FMA dot products: 32 weights against 32 activation bytes per block with
//! `maddubs` (u8 x i8 pairs to i16) and `madd` (to i32), scaled and accumulated in f32.
//! Only reached after `Isa::detect` found AVX2 and FMA on this CPU.
#![allow(unsafe_code)]

use super::super::quant::{Q8Row, WeightType, QK};
use super::QuantRow;
use std::arch::x86_64::*;

/// True when the scales and `act` cover `blocks` blocks (the callers guarantee it; checked so
/// that the unchecked loads below stay in bounds whatever happens).
fn fits(w: &QuantRow<'_>, act: &Q8Row, blocks: usize, needs_m: bool) -> bool {
    act.q.len() >= blocks * QK
        && act.d.len() >= blocks
        && act.s.len() >= blocks
        && w.d.len() >= blocks
        && (!needs_m || w.m.len() >= blocks)
}

pub fn q4_1_q8_1(w: QuantRow<'_>, act: &Q8Row) -> f32 {
    let blocks = w.blocks.len() / 20;
    if !fits(&w, act, blocks, true) {
        return 0.0;
    }
    // SAFETY: AVX2 and FMA are present (Isa::detect); every load below reads inside `row`
    // (block b spans b*20..b*20+20) or `act.q` (b*32..b*32+32, checked by `fits`).
    unsafe { q4_1_q8_1_impl(w, act, blocks) }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn q4_1_q8_1_impl(w: QuantRow<'_>, act: &Q8Row, blocks: usize) -> f32 {
    let low = _mm_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    let mut acc = _mm256_setzero_ps();
    let mut offsets = 0.0f32;
    for b in 0..blocks {
        let block = &w.blocks[b * 20..b * 20 + 20];
        let qs = _mm_loadu_si128(block.as_ptr().add(4).cast());
        // Low nibbles are weights 0..16, high nibbles 16..32.
        let wq = _mm256_set_m128i(
            _mm_and_si128(_mm_srli_epi16(qs, 4), low),
            _mm_and_si128(qs, low),
        );
        let a = _mm256_loadu_si256(act.q.as_ptr().add(b * QK).cast());
        let sums = _mm256_madd_epi16(_mm256_maddubs_epi16(wq, a), ones);
        let scale = _mm256_set1_ps(w.d[b] * act.d[b]);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc);
        // GCC contracts ggml's `summs += m * s` into one fused multiply-add.
        offsets = w.m[b].mul_add(act.s[b], offsets);
    }
    hsum(acc) + offsets
}

pub fn q4_0_q8_0(w: QuantRow<'_>, act: &Q8Row) -> f32 {
    let blocks = w.blocks.len() / 18;
    if !fits(&w, act, blocks, false) {
        return 0.0;
    }
    // SAFETY: as for `q4_1_q8_1`, with 18-byte blocks.
    unsafe { q4_0_q8_0_impl(w, act, blocks) }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn q4_0_q8_0_impl(w: QuantRow<'_>, act: &Q8Row, blocks: usize) -> f32 {
    let low = _mm_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    let eight = _mm256_set1_epi8(8);
    let mut acc = _mm256_setzero_ps();
    for b in 0..blocks {
        let block = &w.blocks[b * 18..b * 18 + 18];
        let qs = _mm_loadu_si128(block.as_ptr().add(2).cast());
        let wq = _mm256_set_m128i(
            _mm_and_si128(_mm_srli_epi16(qs, 4), low),
            _mm_and_si128(qs, low),
        );
        let a = _mm256_loadu_si256(act.q.as_ptr().add(b * QK).cast());
        // (w - 8) . a = w . a - 8 * sum(a)
        let wa = _mm256_madd_epi16(_mm256_maddubs_epi16(wq, a), ones);
        let ea = _mm256_madd_epi16(_mm256_maddubs_epi16(eight, a), ones);
        let scale = _mm256_set1_ps(w.d[b] * act.d[b]);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(wa, ea)), scale, acc);
    }
    hsum(acc)
}

pub fn q8_0_q8_0(w: QuantRow<'_>, act: &Q8Row) -> f32 {
    let blocks = w.blocks.len() / 34;
    if !fits(&w, act, blocks, false) {
        return 0.0;
    }
    // SAFETY: as for `q4_1_q8_1`, with 34-byte blocks whose weights are bytes 2..34.
    unsafe { q8_0_q8_0_impl(w, act, blocks) }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn q8_0_q8_0_impl(w: QuantRow<'_>, act: &Q8Row, blocks: usize) -> f32 {
    let ones = _mm256_set1_epi16(1);
    let mut acc = _mm256_setzero_ps();
    for b in 0..blocks {
        let block = &w.blocks[b * 34..b * 34 + 34];
        let wq = _mm256_loadu_si256(block.as_ptr().add(2).cast());
        let a = _mm256_loadu_si256(act.q.as_ptr().add(b * QK).cast());
        // maddubs wants one unsigned operand: |w| . (a with w's sign).
        let products = _mm256_maddubs_epi16(_mm256_sign_epi8(wq, wq), _mm256_sign_epi8(a, wq));
        let sums = _mm256_madd_epi16(products, ones);
        let scale = _mm256_set1_ps(w.d[b] * act.d[b]);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc);
    }
    hsum(acc)
}

#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}

/// Bytes per block, and whether blocks carry Q4_1's offset, of the kinds with tiled kernels
/// (Q4_1 and Q8_0).
pub(super) fn tiled_layout(kind: WeightType) -> Option<(usize, bool)> {
    match kind {
        WeightType::Q4_1 => Some((20, true)),
        WeightType::Q8_0 => Some((34, false)),
        _ => None,
    }
}

/// Whether every row's bytes and scales (and offsets, for Q4_1) cover `blocks` blocks.
pub(super) fn rows_cover(rows: &[QuantRow<'_>], blocks: usize, size: usize, q4: bool) -> bool {
    rows.iter().all(|w| {
        w.blocks.len() >= blocks * size && w.d.len() >= blocks && (!q4 || w.m.len() >= blocks)
    })
}

/// `R` weight rows against `T` activation rows at once (Q4_1 or Q8_0; `false` for other
/// kinds): each weight block is unpacked once for all `T` tokens, and the `R * T` independent
/// accumulator chains keep the FMA units busy. Every (row, token) pair goes through exactly
/// the operations of the one-pair kernels above, so results are bit-identical to them.
/// With `vnni`, the integer sums come from one `vpdpbusd` (AVX-512 VNNI on 256-bit registers)
/// instead of `maddubs` + `madd`: the same exact sums, so the same results.
pub fn tile<const R: usize, const T: usize>(
    kind: WeightType,
    rows: &[QuantRow<'_>; R],
    acts: &[&Q8Row; T],
    out: &mut [[f32; T]; R],
    vnni: bool,
) -> bool {
    let Some((size, q4)) = tiled_layout(kind) else {
        return false;
    };
    let blocks = rows[0].blocks.len() / size;
    let fit = rows_cover(rows, blocks, size, q4)
        && rows
            .iter()
            .all(|w| acts.iter().all(|a| fits(w, a, blocks, q4)));
    if !fit {
        return false;
    }
    // SAFETY: AVX2 and FMA are present (Isa::detect), and AVX-512 VNNI + VL when `vnni`;
    // `fit` checked every row and activation covers `blocks` blocks, which bounds every load.
    unsafe {
        match (q4, vnni) {
            (true, false) => wrappers::q4_1_tile(rows, acts, blocks, out),
            (false, false) => wrappers::q8_0_tile(rows, acts, blocks, out),
            (true, true) => wrappers::q4_1_tile_vnni(rows, acts, blocks, out),
            (false, true) => wrappers::q8_0_tile_vnni(rows, acts, blocks, out),
        }
    }
    true
}

/// The tile kernels compiled for each instruction set (the bodies are inlined into these).
mod wrappers {
    use super::*;

    macro_rules! wrapper {
        ($name:ident, $body:ident, $features:literal, $vnni:literal) => {
            #[target_feature(enable = $features)]
            pub unsafe fn $name<const R: usize, const T: usize>(
                rows: &[QuantRow<'_>; R],
                acts: &[&Q8Row; T],
                blocks: usize,
                out: &mut [[f32; T]; R],
            ) {
                super::$body::<R, T, $vnni>(rows, acts, blocks, out);
            }
        };
    }

    wrapper!(q4_1_tile, q4_1_tile, "avx2,fma", false);
    wrapper!(q8_0_tile, q8_0_tile, "avx2,fma", false);
    wrapper!(
        q4_1_tile_vnni,
        q4_1_tile,
        "avx2,fma,avx512vnni,avx512vl",
        true
    );
    wrapper!(
        q8_0_tile_vnni,
        q8_0_tile,
        "avx2,fma,avx512vnni,avx512vl",
        true
    );
}

/// Σ u[i] * s[i] over each group of 4 bytes, as 8 i32 lanes (`u` unsigned, `s` signed).
#[inline(always)]
unsafe fn dot_u8_i8<const VNNI: bool>(u: __m256i, s: __m256i) -> __m256i {
    if VNNI {
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s)
    } else {
        _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
    }
}

#[inline(always)]
unsafe fn q4_1_tile<const R: usize, const T: usize, const VNNI: bool>(
    rows: &[QuantRow<'_>; R],
    acts: &[&Q8Row; T],
    blocks: usize,
    out: &mut [[f32; T]; R],
) {
    let low = _mm_set1_epi8(0x0F);
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    let mut offsets = [[0.0f32; T]; R];
    for b in 0..blocks {
        // The activations' codes and scales for this block, loaded once for all rows. (Every
        // `get_unchecked` index is below `blocks`, which the caller checked against every
        // length.)
        let a: [__m256i; T] =
            std::array::from_fn(|t| _mm256_loadu_si256(acts[t].q.as_ptr().add(b * QK).cast()));
        let ad: [f32; T] = std::array::from_fn(|t| *acts[t].d.get_unchecked(b));
        let as_: [f32; T] = std::array::from_fn(|t| *acts[t].s.get_unchecked(b));
        for r in 0..R {
            let w = &rows[r];
            let (wd, wm) = (*w.d.get_unchecked(b), *w.m.get_unchecked(b));
            let qs = _mm_loadu_si128(w.blocks.as_ptr().add(b * 20 + 4).cast());
            let wq = _mm256_set_m128i(
                _mm_and_si128(_mm_srli_epi16(qs, 4), low),
                _mm_and_si128(qs, low),
            );
            for t in 0..T {
                let sums = dot_u8_i8::<VNNI>(wq, a[t]);
                let scale = _mm256_set1_ps(wd * ad[t]);
                acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[r][t]);
                offsets[r][t] = wm.mul_add(as_[t], offsets[r][t]);
            }
        }
    }
    for r in 0..R {
        for t in 0..T {
            out[r][t] = hsum(acc[r][t]) + offsets[r][t];
        }
    }
}

#[inline(always)]
unsafe fn q8_0_tile<const R: usize, const T: usize, const VNNI: bool>(
    rows: &[QuantRow<'_>; R],
    acts: &[&Q8Row; T],
    blocks: usize,
    out: &mut [[f32; T]; R],
) {
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    for b in 0..blocks {
        // As in `q4_1_tile`: loaded once per block; indices below `blocks`, checked.
        let a: [__m256i; T] =
            std::array::from_fn(|t| _mm256_loadu_si256(acts[t].q.as_ptr().add(b * QK).cast()));
        let ad: [f32; T] = std::array::from_fn(|t| *acts[t].d.get_unchecked(b));
        for r in 0..R {
            let w = &rows[r];
            let wd = *w.d.get_unchecked(b);
            let wq = _mm256_loadu_si256(w.blocks.as_ptr().add(b * 34 + 2).cast());
            let abs_w = _mm256_sign_epi8(wq, wq);
            for t in 0..T {
                let sums = dot_u8_i8::<VNNI>(abs_w, _mm256_sign_epi8(a[t], wq));
                let scale = _mm256_set1_ps(wd * ad[t]);
                acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[r][t]);
            }
        }
    }
    for r in 0..R {
        for t in 0..T {
            out[r][t] = hsum(acc[r][t]);
        }
    }
}
