//! Matrix times a batch of activation rows, split over output rows across the backend's
//! threads, so that every weight is read once per step whatever the batch size.

use super::acts::{Activations, Group8, GROUP};
use super::dot::{tile, tile8, Isa, QuantRow};
use super::quant::{Q8Row, WeightType, QK};
use super::team::Team;
use super::weights::{Matrix, MatrixData};

/// Output rows computed per task.
const ROWS_PER_TASK: usize = 16;

/// ... for a single token, where the product streams its weights from memory: longer runs per
/// task keep each thread's reads sequential for the prefetchers (2-thread decode measured ~5 %
/// faster than with 16), still several tasks per thread for a 576-row product.
const ROWS_PER_SINGLE_TASK: usize = 96;

/// Where matrix products run: the kernel set and the threads.
#[derive(Clone, Copy)]
pub struct Matmul<'a> {
    pub isa: Isa,
    pub team: &'a Team,
}

impl Matmul<'_> {
    /// `out[t * rows + r] = W[r] . x[t]` for the `tokens` activation rows, given both quantised
    /// (`acts`, for quantised weights) and as f32 (`xs`, for float weights).
    pub fn run(
        &self,
        w: &Matrix,
        acts: &Activations,
        xs: &[f32],
        tokens: usize,
        out: &mut [f32],
        scratch: &mut Vec<f32>,
    ) {
        self.run_together([w], acts, xs, tokens, [out], [scratch]);
    }

    /// Several products of the same input at once (Q, K and V; gate and up), in one parallel
    /// loop, so that the threads meet once instead of once per product.
    pub fn run_together<const N: usize>(
        &self,
        ws: [&Matrix; N],
        acts: &Activations,
        xs: &[f32],
        tokens: usize,
        outs: [&mut [f32]; N],
        scratch: [&mut Vec<f32>; N],
    ) {
        let rows_per_task = if tokens == 1 {
            ROWS_PER_SINGLE_TASK
        } else {
            ROWS_PER_TASK
        };
        let compute = |m: usize, i: usize, dst: &mut [f32]| {
            compute_rows(self.isa, ws[m], i * rows_per_task, acts, xs, tokens, dst);
        };
        let chunk = rows_per_task * tokens;
        if tokens == 1 {
            // One token: row-major by output row is the output's own layout.
            self.team
                .for_each_chunks(leading(outs, ws, 1), chunk, compute);
            return;
        }
        // Computed row-major by output row ([r][t]), so tasks own disjoint slices; then
        // transposed into `out`.
        let mut scratch = scratch;
        for (s, w) in scratch.iter_mut().zip(ws) {
            if s.len() < w.rows * tokens {
                s.resize(w.rows * tokens, 0.0);
            }
        }
        let values = leading(scratch.each_mut().map(|s| &mut s[..]), ws, tokens);
        self.team.for_each_chunks(values, chunk, compute);
        for ((w, out), s) in ws.iter().zip(outs).zip(&scratch) {
            transpose(self.team, &s[..w.rows * tokens], w.rows, tokens, out);
        }
    }
}

/// The first `rows * tokens` values of each slice, matrix by matrix.
fn leading<'a, const N: usize>(
    slices: [&'a mut [f32]; N],
    ws: [&Matrix; N],
    tokens: usize,
) -> [&'a mut [f32]; N] {
    let mut rows = ws.map(|w| w.rows).into_iter();
    slices.map(|s| &mut s[..rows.next().unwrap_or_default() * tokens])
}

/// Rows `first..` of `w` (as many as `dst` holds, `tokens` values each) against every token.
fn compute_rows(
    isa: Isa,
    w: &Matrix,
    first: usize,
    acts: &Activations,
    xs: &[f32],
    tokens: usize,
    dst: &mut [f32],
) {
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
}

/// `values` ([r][t]) into `out` ([t][r]), eight tokens per task: each row's eight values are
/// read together, and a task's writes stay within its tokens' rows.
fn transpose(team: &Team, values: &[f32], rows: usize, tokens: usize, out: &mut [f32]) {
    const TOKENS_PER_TASK: usize = 8;
    team.for_each_chunk(
        &mut out[..rows * tokens],
        rows * TOKENS_PER_TASK,
        |c, dst| {
            let first = c * TOKENS_PER_TASK;
            let n = dst.len() / rows;
            for r in 0..rows {
                let src = &values[r * tokens + first..r * tokens + first + n];
                for (t, v) in src.iter().enumerate() {
                    dst[t * rows + r] = *v;
                }
            }
        },
    );
}

/// Rows `first..` of a quantised matrix (as many as `dst` holds, `tokens` values each) against
/// every activation: interleaved groups of 8 tokens by 2 rows at a time where the Isa has
/// group kernels, then 4 tokens by 2 rows, then the last 2 or 3 tokens of Q4_1 by 2 rows (a
/// short verification step unpacks each weight once), and the rest token by token.
fn quantized_rows<'w>(
    isa: Isa,
    kind: WeightType,
    row: impl Fn(usize) -> QuantRow<'w>,
    first: usize,
    acts: &Activations,
    tokens: usize,
    dst: &mut [f32],
) {
    let n = dst.len() / tokens;
    let groups = if isa.tiles_groups() && matches!(kind, WeightType::Q4_1 | WeightType::Q8_0) {
        acts.groups()
    } else {
        &[]
    };
    for (g, group) in groups.iter().enumerate() {
        for i in (0..n).step_by(2) {
            let (dst, t) = (&mut dst[i * tokens..], g * GROUP);
            if i + 1 < n {
                let rows = [row(first + i), row(first + i + 1)];
                group_tile(isa, kind, &rows, group, dst, tokens, t);
            } else {
                group_tile(isa, kind, &[row(first + i)], group, dst, tokens, t);
            }
        }
    }
    let grouped = groups.len() * GROUP;
    let rows = Rows {
        isa,
        kind,
        row: &row,
        first,
        acts: &acts.rows,
        tokens,
    };
    let whole = grouped + (tokens - grouped) / 4 * 4;
    for t in (grouped..whole).step_by(4) {
        rows.against::<4>(t, dst);
    }
    // Q4_1's tiles share each block's unpacking; Q8_0's have none to share, and its short
    // tiles measured slower than a pass per token.
    match (tokens - whole, kind) {
        (3, WeightType::Q4_1) => rows.against::<3>(whole, dst),
        (2, WeightType::Q4_1) => rows.against::<2>(whole, dst),
        _ => {
            // Row by row: at batch 1 the product is bound by memory, where grouping rows
            // measured no faster.
            for t in whole..tokens {
                for i in 0..n {
                    let mut out = [[0.0; 1]; 1];
                    tile(isa, kind, &[row(first + i)], &[&acts.rows[t]], &mut out);
                    dst[i * tokens + t] = out[0][0];
                }
            }
        }
    }
}

/// Rows `first..` of a quantised matrix against activation rows, by tiles.
struct Rows<'a, 'w, F: Fn(usize) -> QuantRow<'w>> {
    isa: Isa,
    kind: WeightType,
    row: &'a F,
    first: usize,
    acts: &'a [Q8Row],
    tokens: usize,
}

impl<'w, F: Fn(usize) -> QuantRow<'w>> Rows<'_, 'w, F> {
    /// Every row of `dst` (`tokens` values each) against activations `t..t + T`, two rows at
    /// a time.
    fn against<const T: usize>(&self, t: usize, dst: &mut [f32]) {
        let (n, tokens) = (dst.len() / self.tokens, self.tokens);
        let a: [&Q8Row; T] = std::array::from_fn(|k| &self.acts[t + k]);
        let row = |i: usize| (self.row)(self.first + i);
        let mut i = 0;
        while i + 2 <= n {
            let mut out = [[0.0; T]; 2];
            tile(self.isa, self.kind, &[row(i), row(i + 1)], &a, &mut out);
            for (k, o) in out.iter().enumerate() {
                dst[(i + k) * tokens + t..][..T].copy_from_slice(o);
            }
            i += 2;
        }
        if i < n {
            let mut out = [[0.0; T]; 1];
            tile(self.isa, self.kind, &[row(i)], &a, &mut out);
            dst[i * tokens + t..][..T].copy_from_slice(&out[0]);
        }
    }
}

/// `R` rows against one group of eight tokens (the first of them token `t`), into `dst`'s
/// rows of `tokens` values.
fn group_tile<const R: usize>(
    isa: Isa,
    kind: WeightType,
    rows: &[QuantRow<'_>; R],
    group: &Group8,
    dst: &mut [f32],
    tokens: usize,
    t: usize,
) {
    let mut out = [[0.0; GROUP]; R];
    let covered = tile8(isa, kind, rows, group, &mut out);
    debug_assert!(
        covered,
        "group kernels cover Q4_1 and Q8_0 rows of whole blocks"
    );
    for (k, o) in out.iter().enumerate() {
        dst[k * tokens + t..k * tokens + t + GROUP].copy_from_slice(o);
    }
}
