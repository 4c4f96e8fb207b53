//! Plain Rust dot products (any CPU).

use super::super::quant::{Q8Row, QK};
use super::QuantRow;

pub fn q4_1_q8_1(w: QuantRow<'_>, act: &Q8Row) -> f32 {
    let mut sum = 0.0f32;
    for (b, block) in w.blocks.chunks_exact(20).enumerate() {
        let a = &act.q[b * QK..(b + 1) * QK];
        let mut sumi = 0i32;
        for j in 0..16 {
            let q = block[4 + j];
            sumi +=
                i32::from(q & 0x0F) * i32::from(a[j]) + i32::from(q >> 4) * i32::from(a[j + 16]);
        }
        sum += w.d[b] * act.d[b] * sumi as f32 + w.m[b] * act.s[b];
    }
    sum
}

pub fn q4_0_q8_0(w: QuantRow<'_>, act: &Q8Row) -> f32 {
    let mut sum = 0.0f32;
    for (b, block) in w.blocks.chunks_exact(18).enumerate() {
        let a = &act.q[b * QK..(b + 1) * QK];
        let mut sumi = 0i32;
        for j in 0..16 {
            let q = block[2 + j];
            sumi += (i32::from(q & 0x0F) - 8) * i32::from(a[j])
                + (i32::from(q >> 4) - 8) * i32::from(a[j + 16]);
        }
        sum += w.d[b] * act.d[b] * sumi as f32;
    }
    sum
}

pub fn q8_0_q8_0(w: QuantRow<'_>, act: &Q8Row) -> f32 {
    let mut sum = 0.0f32;
    for (b, block) in w.blocks.chunks_exact(34).enumerate() {
        let a = &act.q[b * QK..(b + 1) * QK];
        let sumi: i32 = block[2..34]
            .iter()
            .zip(a)
            .map(|(&q, &x)| i32::from(q as i8) * i32::from(x))
            .sum();
        sum += w.d[b] * act.d[b] * sumi as f32;
    }
    sum
}
