//! Matrix times a batch of activation rows, split over output rows across the backend's
//! threads, so that every weight is read once per step whatever the batch size.

use super::dot::{dot, Isa, QuantRow};
use super::quant::{Q8Row, QK};
use super::weights::{Matrix, MatrixData};
use rayon::prelude::*;

/// Output rows computed per task.
const ROWS_PER_TASK: usize = 64;

/// Where matrix products run: the kernel set and the thread pool (none: this thread).
#[derive(Clone, Copy)]
pub struct Matmul<'a> {
    pub isa: Isa,
    pub pool: Option<&'a rayon::ThreadPool>,
}

impl Matmul<'_> {
    /// `out[t * rows + r] = W[r] . x[t]` for the `tokens` activation rows, given both quantised
    /// (`acts`, for quantised weights) and as f32 (`xs`, for float weights).
    pub fn run(
        &self,
        w: &Matrix,
        acts: &[Q8Row],
        xs: &[f32],
        tokens: usize,
        out: &mut [f32],
        scratch: &mut Vec<f32>,
    ) {
        let (isa, pool) = (self.isa, self.pool);
        let rows = w.rows;
        // Computed row-major by output row ([r][t]), so tasks own disjoint slices; then
        // transposed into `out`.
        scratch.resize(rows * tokens, 0.0);
        let compute = |(chunk, dst): (usize, &mut [f32])| {
            let first = chunk * ROWS_PER_TASK;
            for (i, per_row) in dst.chunks_exact_mut(tokens).enumerate() {
                let r = first + i;
                match &w.data {
                    MatrixData::Quantized {
                        kind,
                        bytes,
                        row_bytes,
                        d,
                        m,
                    } => {
                        let blocks = w.cols / QK;
                        let row = QuantRow {
                            blocks: &bytes[r * row_bytes..(r + 1) * row_bytes],
                            d: &d[r * blocks..(r + 1) * blocks],
                            m: if m.is_empty() {
                                &[]
                            } else {
                                &m[r * blocks..(r + 1) * blocks]
                            },
                        };
                        for (t, o) in per_row.iter_mut().enumerate() {
                            *o = dot(isa, *kind, row, &acts[t]);
                        }
                    }
                    MatrixData::F32(v) => {
                        let row = &v[r * w.cols..(r + 1) * w.cols];
                        for (t, o) in per_row.iter_mut().enumerate() {
                            *o = row
                                .iter()
                                .zip(&xs[t * w.cols..(t + 1) * w.cols])
                                .map(|(a, b)| a * b)
                                .sum();
                        }
                    }
                }
            }
        };
        let chunk = ROWS_PER_TASK * tokens;
        match pool {
            Some(pool) => {
                pool.install(|| scratch.par_chunks_mut(chunk).enumerate().for_each(compute))
            }
            None => scratch.chunks_mut(chunk).enumerate().for_each(compute),
        }
        for (r, per_row) in scratch.chunks_exact(tokens).enumerate() {
            for (t, v) in per_row.iter().enumerate() {
                out[t * rows + r] = *v;
            }
        }
    }
}
