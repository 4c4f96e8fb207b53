//! Dot products of one quantised weight row with one quantised activation row: the inner loop
//! of every matrix product. A portable version and an AVX2 version, chosen once at run time
//! from what the CPU supports. Both give bit-identical results, the same as llama.cpp's AVX2
//! kernels: this model turns last-bit differences into different tokens.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod portable;

use super::acts::{Group8, GROUP};
use super::quant::{Q8Row, WeightType};

/// Which implementation runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    Portable,
    Avx2,
    /// AVX-512 (F, BW, VL, VNNI): the AVX2 kernels with VNNI integer dot products, and for
    /// groups of eight tokens, kernels that carry two tokens per 512-bit register (one
    /// token's 256-bit lanes per half: wider lanes for one token would change which sums
    /// llama.cpp's AVX2 order groups together).
    Avx512Vnni,
}

impl Isa {
    /// The best this CPU supports (or a lesser one that `KVGATE_ISA=portable|avx2` asks for).
    pub fn detect() -> Isa {
        let forced = std::env::var("KVGATE_ISA").unwrap_or_default();
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            let avx2 = has!("avx2") && has!("fma");
            let vnni = avx2
                && has!("avx512f")
                && has!("avx512bw")
                && has!("avx512vl")
                && has!("avx512vnni");
            match forced.as_str() {
                "portable" => {}
                "avx2" if avx2 => return Isa::Avx2,
                _ if vnni => return Isa::Avx512Vnni,
                _ if avx2 => return Isa::Avx2,
                _ => {}
            }
        }
        let _ = forced;
        Isa::Portable
    }

    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512Vnni => "avx512-vnni",
        }
    }

    /// Whether AVX2 and FMA are present (every kernel set but the portable one).
    pub fn has_avx2_fma(self) -> bool {
        self != Isa::Portable
    }

    /// Whether `tile8` has kernels here (so that activations are worth interleaving).
    pub fn tiles_groups(self) -> bool {
        self == Isa::Avx512Vnni
    }
}

/// One weight row: its ggml blocks, and each block's scale (and Q4_1 offset) converted from
/// f16 once at load, so the inner loop does not convert.
#[derive(Debug, Clone, Copy)]
pub struct QuantRow<'a> {
    pub blocks: &'a [u8],
    pub d: &'a [f32],
    /// Q4_1 only; empty otherwise.
    pub m: &'a [f32],
}

/// `weights · activation` for one row (a whole number of 32-weight blocks).
pub fn dot(isa: Isa, kind: WeightType, row: QuantRow<'_>, act: &Q8Row) -> f32 {
    match (isa, kind) {
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2 | Isa::Avx512Vnni, WeightType::Q4_1) => avx2::q4_1_q8_1(row, act),
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2 | Isa::Avx512Vnni, WeightType::Q8_0) => avx2::q8_0_q8_0(row, act),
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2 | Isa::Avx512Vnni, WeightType::Q4_0) => avx2::q4_0_q8_0(row, act),
        (_, WeightType::Q4_1) => portable::q4_1_q8_1(row, act),
        (_, WeightType::Q8_0) => portable::q8_0_q8_0(row, act),
        (_, WeightType::Q4_0) => portable::q4_0_q8_0(row, act),
        // Float weights are converted to Q8_0 at load (see `weights.rs`).
        (_, WeightType::F32 | WeightType::F16 | WeightType::BF16) => 0.0,
    }
}

/// `R` rows against `T` activations: `out[r][t] = rows[r] · acts[t]`, bit-identical to `dot`
/// pair by pair, faster where a tiled kernel exists (AVX2, Q4_1 and Q8_0).
pub fn tile<const R: usize, const T: usize>(
    isa: Isa,
    kind: WeightType,
    rows: &[QuantRow<'_>; R],
    acts: &[&Q8Row; T],
    out: &mut [[f32; T]; R],
) {
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx2_fma() && avx2::tile(kind, rows, acts, out, isa == Isa::Avx512Vnni) {
        return;
    }
    for (row, out) in rows.iter().zip(out.iter_mut()) {
        for (act, o) in acts.iter().zip(out.iter_mut()) {
            *o = dot(isa, kind, *row, act);
        }
    }
}

/// `R` rows against a group of eight tokens, bit-identical to `dot` pair by pair; `false`
/// where this Isa has no group kernel for `kind` (the caller then uses `tile`).
pub fn tile8<const R: usize>(
    isa: Isa,
    kind: WeightType,
    rows: &[QuantRow<'_>; R],
    group: &Group8,
    out: &mut [[f32; GROUP]; R],
) -> bool {
    #[cfg(target_arch = "x86_64")]
    if isa.tiles_groups() {
        return avx512::tile8(kind, rows, group, out);
    }
    let _ = (isa, kind, rows, group, out);
    false
}

#[cfg(test)]
mod tests {
    use super::super::acts::Activations;
    use super::super::quant::{dequantize_row, QK};
    use super::*;
    use half::f16;
    use proptest::prelude::*;

    fn random_row(kind: WeightType, blocks: usize, seed: u64) -> Vec<u8> {
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let size = kind.row_bytes(QK);
        let mut row = Vec::new();
        for _ in 0..blocks {
            let mut block: Vec<u8> = (0..size).map(|_| next() as u8).collect();
            let d = f16::from_f32(0.001 + (next() % 1000) as f32 * 1e-4);
            block[0..2].copy_from_slice(&d.to_bits().to_le_bytes());
            if kind == WeightType::Q4_1 {
                let m = f16::from_f32(-((next() % 1000) as f32) * 1e-4);
                block[2..4].copy_from_slice(&m.to_bits().to_le_bytes());
            }
            row.extend(block);
        }
        row
    }

    proptest! {
        /// Every implementation agrees with dequantise-then-multiply on the same quantised
        /// activation, within float rounding.
        #[test]
        fn kernels_agree(blocks in 1usize..40, seed in any::<u64>(), xs in prop::collection::vec(-4.0f32..4.0, 32 * 40)) {
            let mut act = Q8Row::default();
            act.quantize(&xs[..blocks * QK]);
            let deq_act: Vec<f32> = (0..blocks * QK).map(|i| f32::from(act.q[i]) * act.d[i / QK]).collect();
            for kind in [WeightType::Q4_1, WeightType::Q8_0, WeightType::Q4_0] {
                let row = random_row(kind, blocks, seed);
                let (d, m) = super::super::weights::block_scales(kind, &row);
                let qrow = QuantRow { blocks: &row, d: &d, m: &m };
                let mut w = vec![0f32; blocks * QK];
                dequantize_row(kind, &row, &mut w);
                let mut reference: f64 = w.iter().zip(&deq_act).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum();
                if kind == WeightType::Q4_1 {
                    // Q4_1's offset term uses the f16-rounded block sum `s`, as llama.cpp does.
                    let m: Vec<f32> = row.chunks_exact(20).map(|b| f16::from_bits(u16::from_le_bytes([b[2], b[3]])).to_f32()).collect();
                    let exact_offset: f64 = (0..blocks).map(|b| f64::from(m[b]) * deq_act[b * QK..(b + 1) * QK].iter().map(|v| f64::from(*v)).sum::<f64>()).sum();
                    let stored_offset: f64 = (0..blocks).map(|b| f64::from(m[b]) * f64::from(act.s[b])).sum();
                    reference += stored_offset - exact_offset;
                }
                let portable = dot(Isa::Portable, kind, qrow, &act);
                let got = f64::from(portable);
                prop_assert!((got - reference).abs() <= 1e-3 * (1.0 + reference.abs()), "{kind:?}: {got} vs {reference}");
                let best = dot(Isa::detect(), kind, qrow, &act);
                prop_assert_eq!(portable.to_bits(), best.to_bits(), "{:?}: portable and {:?} differ", kind, Isa::detect());
                for isa in [Isa::Avx2, Isa::Avx512Vnni] {
                    if isa == Isa::Avx512Vnni && Isa::detect() != isa || !Isa::detect().has_avx2_fma() {
                        continue;
                    }
                    let mut tiled = [[0.0f32; 3]; 2];
                    tile(isa, kind, &[qrow, qrow], &[&act, &act, &act], &mut tiled);
                    prop_assert!(tiled.iter().flatten().all(|v| v.to_bits() == best.to_bits()), "{kind:?} {isa:?}: tiled {tiled:?} vs {best}");
                }
                if Isa::detect().tiles_groups() && kind != WeightType::Q4_0 {
                    // Eight different tokens (scaled copies), each checked against `dot`.
                    let mut acts = Activations::default();
                    acts.reserve(8);
                    for (t, row) in acts.rows.iter_mut().enumerate() {
                        let x: Vec<f32> = xs[..blocks * QK].iter().enumerate().map(|(i, v)| v * (1.0 + t as f32 * 0.37) - (i % (t + 2)) as f32 * 0.1).collect();
                        row.quantize(&x);
                    }
                    acts.pack(8, true, &super::super::team::Team::new(1).unwrap());
                    let mut grouped = [[0.0f32; GROUP]; 2];
                    prop_assert!(tile8(Isa::detect(), kind, &[qrow, qrow], &acts.groups()[0], &mut grouped));
                    for (t, row) in acts.rows.iter().enumerate() {
                        let one = dot(Isa::detect(), kind, qrow, row);
                        prop_assert_eq!(grouped[0][t].to_bits(), one.to_bits(), "{:?} token {}: {} vs {}", kind, t, grouped[0][t], one);
                        prop_assert_eq!(grouped[1][t].to_bits(), one.to_bits());
                    }
                }
            }
        }
    }
}
