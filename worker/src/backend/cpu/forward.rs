//! One forward pass over a step's batch: every token of every slice goes through the layers
//! together (so each weight is read once per step); attention reads each request's earlier
//! K/V through its block table; logits are computed only where the step samples.

use super::acts::Activations;
use super::attention::{self, HeadInputs, SumOrder};
use super::dot::Isa;
use super::ggml_math;
use super::kv_cache::KvCache;
use super::matmul::Matmul;
use super::team::Team;
use super::weights::Weights;
use crate::backend::BatchSlice;
use std::sync::Arc;

/// Reusable buffers, grown to the largest step seen (no allocation per step after warm-up).
#[derive(Default)]
struct Scratch {
    x: Vec<f32>,
    xb: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    acts: Activations,
    /// One buffer per product that may run at once (Q, K and V together).
    matmul: [Vec<f32>; 3],
    /// Per token of the step: which offsets it attends over, and in which summation order.
    attention_jobs: Vec<AttentionJob>,
    rope: Vec<(f32, f32)>,
    positions: Vec<usize>,
    offsets: Vec<usize>,
    /// (slice index, token row) of the tokens whose logits are needed.
    sample_rows: Vec<(usize, usize)>,
    logits: Vec<f32>,
}

#[derive(Debug, Clone, Copy)]
struct AttentionJob {
    first: usize,
    visible: usize,
    order: SumOrder,
}

thread_local! {
    /// Scores and lanes of the attention running on this thread (grown once, then reused).
    static ATTENTION_SCRATCH: std::cell::RefCell<(Vec<f32>, Vec<f32>)> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// The logits of one step: a row for each sampling slice, or with a draft one for each of its
/// last `draft + 1` tokens, in batch order.
pub struct Logits<'a> {
    slices: &'a [(usize, usize)],
    values: &'a [f32],
    vocab: usize,
}

impl Logits<'_> {
    /// (index of the slice in the batch, one row's logits), in batch and row order.
    pub fn iter(&self) -> impl Iterator<Item = (usize, &[f32])> + '_ {
        self.slices
            .iter()
            .zip(self.values.chunks_exact(self.vocab))
            .map(|(&(i, _), l)| (i, l))
    }
}

pub struct Forward {
    /// Shared with copies (a draft model's fork).
    pub weights: Arc<Weights>,
    pub kv: KvCache,
    isa: Isa,
    /// Shared with a draft model's forward pass, which runs between this one's steps.
    team: Arc<Team>,
    scratch: Scratch,
    /// Each RoPE pair's angle per position step, as a ratio to the previous pair's.
    theta_scale: f32,
}

fn grow(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if v.len() < n {
        v.resize(n, 0.0);
    }
    &mut v[..n]
}

/// llama.cpp's RMSNorm: f32 squares summed in f64, the scale in f32.
fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let sum: f64 = x.iter().map(|v| f64::from(v * v)).sum();
    let scale = 1.0 / ((sum / x.len() as f64) as f32 + eps).sqrt();
    for ((o, v), g) in out.iter_mut().zip(x).zip(w) {
        *o = v * scale * g;
    }
}

impl Forward {
    pub fn new(weights: Arc<Weights>, kv: KvCache, isa: Isa, team: Arc<Team>) -> Forward {
        let p = &weights.params;
        let hd = p.head_dim;
        let theta_scale = p.rope_theta.powf(-2.0 / hd as f32);
        Forward {
            weights,
            kv,
            isa,
            team,
            scratch: Scratch::default(),
            theta_scale,
        }
    }

    pub fn isa(&self) -> Isa {
        self.isa
    }

    pub fn team(&self) -> &Arc<Team> {
        &self.team
    }

    /// Runs the batch; returns the logits of the slices that sample (in buffers reused by the
    /// next step).
    pub fn run(&mut self, batch: &[BatchSlice<'_>]) -> Logits<'_> {
        self.run_here(batch);
        self.logits()
    }

    fn logits(&self) -> Logits<'_> {
        let s = &self.scratch;
        Logits {
            slices: &s.sample_rows,
            values: &s.logits[..s.sample_rows.len() * self.weights.head().rows],
            vocab: self.weights.head().rows,
        }
    }

    fn run_here(&mut self, batch: &[BatchSlice<'_>]) {
        let p = self.weights.params.clone();
        let (h, hd) = (p.hidden, p.head_dim);
        let (q_dim, kv_dim) = (p.heads * hd, p.kv_heads * hd);
        let group = p.heads / p.kv_heads;
        let tokens: usize = batch.iter().map(|s| s.len).sum();
        let s = &mut self.scratch;
        let mm = Matmul {
            isa: self.isa,
            team: &self.team,
        };
        s.acts.reserve(tokens);
        let interleave = self.isa.tiles_groups();

        // Embeddings, positions, RoPE angles, and which rows need logits.
        let x = grow(&mut s.x, tokens * h);
        s.positions.clear();
        s.sample_rows.clear();
        let mut t = 0;
        for (i, slice) in batch.iter().enumerate() {
            for pos in slice.start..slice.start + slice.len {
                let token = slice.tokens[pos] as usize;
                self.weights
                    .embed
                    .row_f32(token.min(p.vocab_size - 1), &mut x[t * h..(t + 1) * h]);
                s.positions.push(pos);
                t += 1;
            }
            if slice.samples {
                // A draft's tokens each need the model's own token at their position, and the
                // last needs the next one: logits for the last `draft + 1` rows.
                let rows = slice.draft.min(slice.len.saturating_sub(1)) + 1;
                s.sample_rows.extend((t - rows..t).map(|row| (i, row)));
            }
        }
        // The KV-cache offsets each token attends to (its request's positions up to its own):
        // one list per slice, each token a prefix of it. Block tables do not change within a
        // step, so this serves every layer.
        s.offsets.clear();
        s.attention_jobs.clear();
        for slice in batch {
            let first = s.offsets.len();
            let order = SumOrder::for_slice(slice);
            for pos in 0..slice.start + slice.len {
                s.offsets.extend(self.kv.offset(slice.block_table, pos));
                if pos >= slice.start {
                    s.attention_jobs.push(AttentionJob {
                        first,
                        visible: s.offsets.len() - first,
                        order,
                    });
                }
            }
        }
        s.rope.clear();
        for &pos in &s.positions {
            // llama.cpp's angle cache: multiplied up pair by pair, not computed by powers.
            let mut theta = pos as f32;
            for _ in 0..hd / 2 {
                s.rope.push((theta.cos(), theta.sin()));
                theta *= self.theta_scale;
            }
        }

        for (l, layer) in self.weights.layers.iter().enumerate() {
            // Attention block.
            let x = &mut s.x[..tokens * h];
            let xb = grow(&mut s.xb, tokens * h);
            let rows = &mut s.acts.rows[..tokens];
            self.team.for_each_pair((xb, h), (rows, 1), |t, xb, row| {
                rms_norm(&x[t * h..(t + 1) * h], &layer.attn_norm, p.rms_eps, xb);
                row[0].quantize(xb);
            });
            s.acts.pack(tokens, interleave, &self.team);
            let q = grow(&mut s.q, tokens * q_dim);
            let k = grow(&mut s.k, tokens * kv_dim);
            let v = grow(&mut s.v, tokens * kv_dim);
            let [s0, s1, s2] = &mut s.matmul;
            let acts = &s.acts;
            let qkv = [&layer.wq, &layer.wk, &layer.wv];
            mm.run_together(qkv, acts, xb, tokens, [&mut *q, k, v], [s0, s1, s2]);
            for t in 0..tokens {
                let angles = &s.rope[t * hd / 2..(t + 1) * hd / 2];
                for head in q[t * q_dim..(t + 1) * q_dim]
                    .chunks_exact_mut(hd)
                    .chain(k[t * kv_dim..(t + 1) * kv_dim].chunks_exact_mut(hd))
                {
                    ggml_math::rope(self.isa, head, angles);
                }
            }
            // Store this step's K/V, then attend (a token sees its own and earlier positions).
            let mut t = 0;
            for slice in batch {
                for pos in slice.start..slice.start + slice.len {
                    if let Some(off) = self.kv.offset(slice.block_table, pos) {
                        self.kv.write(
                            l,
                            off,
                            &k[t * kv_dim..(t + 1) * kv_dim],
                            &v[t * kv_dim..(t + 1) * kv_dim],
                        );
                    }
                    t += 1;
                }
            }
            let att = grow(&mut s.att, tokens * q_dim);
            let (kc, vc) = self.kv.layer(l);
            let scale = 1.0 / (hd as f32).sqrt();
            // llama.cpp multiplies f16 K by the query converted to f16.
            for v in q.iter_mut() {
                *v = half::f16::from_f32(*v).to_f32();
            }
            // Every (token, head) attends independently: spread them over the threads.
            self.team.for_each_chunk(att, hd, |i, out| {
                let (t, head) = (i / p.heads, i % p.heads);
                let job = s.attention_jobs[t];
                let offsets = &s.offsets[job.first..job.first + job.visible];
                let inputs = HeadInputs {
                    k_cache: kc,
                    v_cache: vc,
                    offsets,
                    kv_head: (head / group) * hd,
                    scale,
                    order: job.order,
                };
                ATTENTION_SCRATCH.with(|cell| {
                    let (scores, lanes) = &mut *cell.borrow_mut();
                    let scores = grow(scores, offsets.len());
                    let lanes = grow(lanes, attention::lanes_len(hd));
                    let q = &q[t * q_dim + head * hd..t * q_dim + (head + 1) * hd];
                    attention::attend(self.isa, &inputs, q, scores, lanes, out);
                });
            });
            let rows = &mut s.acts.rows[..tokens];
            self.team
                .for_each_pair((&mut *att, q_dim), (rows, 1), |_, att, row| {
                    row[0].quantize(att)
                });
            s.acts.pack(tokens, interleave, &self.team);
            let o = grow(&mut s.xb, tokens * h);
            mm.run(&layer.wo, &s.acts, att, tokens, o, &mut s.matmul[0]);
            for (xv, ov) in s.x[..tokens * h].iter_mut().zip(o.iter()) {
                *xv += ov;
            }

            // Feed-forward block (SwiGLU).
            let x = &s.x[..tokens * h];
            let xb = grow(&mut s.xb, tokens * h);
            let rows = &mut s.acts.rows[..tokens];
            self.team.for_each_pair((xb, h), (rows, 1), |t, xb, row| {
                rms_norm(&x[t * h..(t + 1) * h], &layer.ffn_norm, p.rms_eps, xb);
                row[0].quantize(xb);
            });
            s.acts.pack(tokens, interleave, &self.team);
            let gate = grow(&mut s.gate, tokens * p.ffn);
            let up = grow(&mut s.up, tokens * p.ffn);
            let [s0, s1, _] = &mut s.matmul;
            let acts = &s.acts;
            let gate_up = [&layer.w_gate, &layer.w_up];
            mm.run_together(gate_up, acts, xb, tokens, [&mut *gate, up], [s0, s1]);
            let rows = &mut s.acts.rows[..tokens];
            self.team
                .for_each_pair((&mut *gate, p.ffn), (rows, 1), |t, gate, row| {
                    ggml_math::swiglu(self.isa, gate, &up[t * p.ffn..(t + 1) * p.ffn]);
                    row[0].quantize(gate);
                });
            s.acts.pack(tokens, interleave, &self.team);
            let down = grow(&mut s.xb, tokens * h);
            mm.run(&layer.w_down, &s.acts, gate, tokens, down, &mut s.matmul[0]);
            for (xv, dv) in s.x[..tokens * h].iter_mut().zip(down.iter()) {
                *xv += dv;
            }
        }

        // Final norm and the output head, only where a token is sampled.
        let n = s.sample_rows.len();
        let normed = grow(&mut s.xb, n * h);
        for (j, &(_, t)) in s.sample_rows.iter().enumerate() {
            rms_norm(
                &s.x[t * h..(t + 1) * h],
                &self.weights.output_norm,
                p.rms_eps,
                &mut normed[j * h..(j + 1) * h],
            );
            s.acts.rows[j].quantize(&normed[j * h..(j + 1) * h]);
        }
        s.acts.pack(n, interleave, &self.team);
        let head = self.weights.head();
        let logits = grow(&mut s.logits, n * head.rows);
        mm.run(head, &s.acts, normed, n, logits, &mut s.matmul[0]);
    }
}
