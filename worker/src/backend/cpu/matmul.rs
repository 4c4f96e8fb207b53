//! Matrix times a batch of activation rows, split over output rows across the backend's
//! threads, so that every weight is read once per step whatever the batch size.

use super::dot::{tile, Isa, QuantRow};
use super::quant::{Q8Row, WeightType, QK};
use super::weights::{Matrix, MatrixData};
use rayon::prelude::*;

/// Output rows computed per task (small enough that a batch-1 product of 576 rows splits evenly
/// over the threads).
const ROWS_PER_TASK: usize = 16;

/// Where matrix products run: the kernel set and the thread pool (none: this thread).
#[derive(Clone, Copy)]
pub struct Matmul<'a> {
    pub isa: Isa,
    pub pool: Option<&'a rayon::ThreadPool>,
}

impl Matmul<'_> {
    /// Runs `a` and `b` at once on the pool (products that read the same activations, so that
    /// the threads meet once instead of twice); one after the other without a pool.
    pub fn join<A, B>(&self, a: impl FnOnce() -> A + Send, b: impl FnOnce() -> B + Send) -> (A, B)
    where
        A: Send,
        B: Send,
    {
        match self.pool {
            Some(pool) => pool.join(a, b),
            None => (a(), b()),
        }
    }

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
            match &w.data {
                MatrixData::Quantized {
                    kind,
                    bytes,
                    row_bytes,
                    d,
                    m,
                } => {
                    let blocks = w.cols / QK;
                    let row = |r: usize| QuantRow {
                        blocks: &bytes[r * row_bytes..(r + 1) * row_bytes],
                        d: &d[r * blocks..(r + 1) * blocks],
                        m: if m.is_empty() {
                            &[]
                        } else {
                            &m[r * blocks..(r + 1) * blocks]
                        },
                    };
                    quantized_rows(isa, *kind, row, first, acts, tokens, dst);
                }
                MatrixData::F32(v) => {
                    for (i, per_row) in dst.chunks_exact_mut(tokens).enumerate() {
                        let row = &v[(first + i) * w.cols..(first + i + 1) * w.cols];
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

/// Rows `first..` of a quantised matrix (as many as `dst` holds, `tokens` values each) against
/// every activation: 4 tokens by 2 rows at a time, then the remaining tokens row by row.
fn quantized_rows<'w>(
    isa: Isa,
    kind: WeightType,
    row: impl Fn(usize) -> QuantRow<'w>,
    first: usize,
    acts: &[Q8Row],
    tokens: usize,
    dst: &mut [f32],
) {
    let n = dst.len() / tokens;
    let whole = tokens / 4 * 4;
    for t in (0..whole).step_by(4) {
        let a = [&acts[t], &acts[t + 1], &acts[t + 2], &acts[t + 3]];
        let mut i = 0;
        while i + 2 <= n {
            let mut out = [[0.0; 4]; 2];
            tile(
                isa,
                kind,
                &[row(first + i), row(first + i + 1)],
                &a,
                &mut out,
            );
            for (k, o) in out.iter().enumerate() {
                dst[(i + k) * tokens + t..(i + k) * tokens + t + 4].copy_from_slice(o);
            }
            i += 2;
        }
        if i < n {
            let mut out = [[0.0; 4]; 1];
            tile(isa, kind, &[row(first + i)], &a, &mut out);
            dst[i * tokens + t..i * tokens + t + 4].copy_from_slice(&out[0]);
        }
    }
    // Single tokens row by row: at batch 1 the product is bound by memory, where grouping rows
    // measured no faster.
    for t in whole..tokens {
        for i in 0..n {
            let mut out = [[0.0; 1]; 1];
            tile(isa, kind, &[row(first + i)], &[&acts[t]], &mut out);
            dst[i * tokens + t] = out[0][0];
        }
    }
}
