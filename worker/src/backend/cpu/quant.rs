//! ggml block formats: the weights as GGUF stores them, and activations quantised on the fly
//! the way llama.cpp does (Q8_1 against Q4_1 weights, Q8_0 against Q4_0 and Q8_0), so integer
//! dot products do the work and results follow llama.cpp's.

use half::f16;

/// Weights per block in every format here.
pub const QK: usize = 32;

/// A weight format kvgate computes with directly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightType {
    F32,
    F16,
    BF16,
    Q8_0,
    Q4_0,
    Q4_1,
}

impl WeightType {
    /// From a ggml type id; `None` for types kvgate does not support.
    pub fn from_ggml(id: u32) -> Option<WeightType> {
        Some(match id {
            0 => WeightType::F32,
            1 => WeightType::F16,
            2 => WeightType::Q4_0,
            3 => WeightType::Q4_1,
            8 => WeightType::Q8_0,
            30 => WeightType::BF16,
            _ => return None,
        })
    }

    /// Bytes of one row of `cols` weights.
    pub fn row_bytes(self, cols: usize) -> usize {
        match self {
            WeightType::F32 => cols * 4,
            WeightType::F16 | WeightType::BF16 => cols * 2,
            WeightType::Q8_0 => cols / QK * 34,
            WeightType::Q4_0 => cols / QK * 18,
            WeightType::Q4_1 => cols / QK * 20,
        }
    }

    /// Whether rows must be a whole number of 32-weight blocks.
    pub fn is_blocked(self) -> bool {
        matches!(self, WeightType::Q8_0 | WeightType::Q4_0 | WeightType::Q4_1)
    }
}

fn half(bytes: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([bytes[at], bytes[at + 1]])).to_f32()
}

/// Decodes one row of `cols` weights to f32.
pub fn dequantize_row(kind: WeightType, row: &[u8], out: &mut [f32]) {
    match kind {
        WeightType::F32 => {
            for (o, c) in out.iter_mut().zip(row.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        WeightType::F16 => {
            for (i, o) in out.iter_mut().enumerate() {
                *o = half(row, 2 * i);
            }
        }
        WeightType::BF16 => {
            for (o, c) in out.iter_mut().zip(row.chunks_exact(2)) {
                *o = f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16);
            }
        }
        WeightType::Q8_0 => {
            for (block, o) in row.chunks_exact(34).zip(out.chunks_exact_mut(QK)) {
                let d = half(block, 0);
                for (j, v) in o.iter_mut().enumerate() {
                    *v = f32::from(block[2 + j] as i8) * d;
                }
            }
        }
        WeightType::Q4_0 | WeightType::Q4_1 => {
            let (size, offset) = if kind == WeightType::Q4_0 {
                (18, 2)
            } else {
                (20, 4)
            };
            for (block, o) in row.chunks_exact(size).zip(out.chunks_exact_mut(QK)) {
                let d = half(block, 0);
                let (m, bias) = if kind == WeightType::Q4_1 {
                    (half(block, 2), 0.0)
                } else {
                    (0.0, -8.0)
                };
                for j in 0..16 {
                    let q = block[offset + j];
                    o[j] = (f32::from(q & 0x0F) + bias) * d + m;
                    o[j + 16] = (f32::from(q >> 4) + bias) * d + m;
                }
            }
        }
    }
}

/// Rounds half to even, as `_mm256_round_ps(_MM_ROUND_NEAREST)` does, for |x| < 2^22 (codes
/// are within ±127.5): adding and removing 1.5 * 2^23 leaves the float unit to round. Unlike
/// `f32::round_ties_even` it needs no libm call on CPUs targeted without SSE4.1.
fn round_ties_even(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    (x + MAGIC) - MAGIC
}

/// An activation row quantised to 8 bits per 32-value block (ggml's Q8_0 / Q8_1): `d` is the
/// scale, `s` is `d * sum(q)` (used against Q4_1's offset). Scales are rounded through f16 as
/// llama.cpp stores them.
#[derive(Debug, Clone, Default)]
pub struct Q8Row {
    pub q: Vec<i8>,
    pub d: Vec<f32>,
    pub s: Vec<f32>,
}

impl Q8Row {
    pub fn with_capacity(cols: usize) -> Q8Row {
        Q8Row {
            q: vec![0; cols],
            d: vec![0.0; cols / QK],
            s: vec![0.0; cols / QK],
        }
    }

    /// Quantises `x` (a multiple of 32 long) into `self`, reusing its buffers.
    pub fn quantize(&mut self, x: &[f32]) {
        let blocks = x.len() / QK;
        self.q.resize(x.len(), 0);
        self.d.resize(blocks, 0.0);
        self.s.resize(blocks, 0.0);
        for b in 0..blocks {
            let xs = &x[b * QK..(b + 1) * QK];
            let amax = xs.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            // As ggml's AVX2 quantize_row_q8_0/q8_1: 127/amax, ties to even.
            let d = amax / 127.0;
            let id = if amax == 0.0 { 0.0 } else { 127.0 / amax };
            let mut sum = 0i32;
            for (q, &v) in self.q[b * QK..(b + 1) * QK].iter_mut().zip(xs) {
                let r = round_ties_even(v * id) as i32;
                *q = r.clamp(-127, 127) as i8;
                sum += i32::from(*q);
            }
            self.d[b] = f16::from_f32(d).to_f32();
            self.s[b] = f16::from_f32(d * sum as f32).to_f32();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4_1_nibbles_are_first_half_then_second_half() {
        // d = 1, m = -1: weight j is nibble - 1.
        let mut block = vec![0u8; 20];
        block[0..2].copy_from_slice(&f16::from_f32(1.0).to_bits().to_le_bytes());
        block[2..4].copy_from_slice(&f16::from_f32(-1.0).to_bits().to_le_bytes());
        block[4] = 0x52; // low nibble 2 (weight 0), high nibble 5 (weight 16)
        let mut out = [0f32; 32];
        dequantize_row(WeightType::Q4_1, &block, &mut out);
        assert_eq!((out[0], out[16], out[1]), (1.0, 4.0, -1.0));
    }

    #[test]
    fn rounding_is_half_to_even() {
        for (x, r) in [
            (0.5, 0.0),
            (1.5, 2.0),
            (2.5, 2.0),
            (-0.5, -0.0),
            (-1.5, -2.0),
            (126.5, 126.0),
            (0.49, 0.0),
            (-127.4, -127.0),
        ] {
            assert_eq!(round_ties_even(x), r, "{x}");
            assert_eq!(round_ties_even(x), x.round_ties_even(), "{x}");
        }
    }

    #[test]
    fn quantized_activations_round_trip_closely() {
        let x: Vec<f32> = (0..64).map(|i| ((i as f32) * 0.37).sin() * 3.0).collect();
        let mut q = Q8Row::default();
        q.quantize(&x);
        for b in 0..2 {
            for j in 0..QK {
                let back = f32::from(q.q[b * QK + j]) * q.d[b];
                assert!((back - x[b * QK + j]).abs() <= q.d[b] * 0.51 + 1e-3);
            }
            let sum: i32 = q.q[b * QK..(b + 1) * QK]
                .iter()
                .map(|&v| i32::from(v))
                .sum();
            assert!((q.s[b] - q.d[b] * sum as f32).abs() < 1e-2);
        }
    }
}
