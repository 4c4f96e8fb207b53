//! One forward pass on the device: the CPU backend's pass (`cpu/forward.rs`), each step a
//! fixed sequence of kernel launches on one stream.

use super::gpu::{Arg, Buffer, Gpu};
use super::plan::{Rope, StepPlan, StepShape};
use super::weights::{DeviceWeights, Product};
use super::TOP_K_MAX;
use std::collections::HashMap;
use std::sync::Arc;

const THREADS: u32 = 128;
/// Tokens per block of a matrix product (`PRODUCT_TOKENS` in kernels.cu) and outputs per
/// block (8 threads each).
const PRODUCT_TOKENS: usize = 8;
const PRODUCT_ROWS: usize = THREADS as usize / 8;
/// Attention scores held at once: a step whose tokens see more is attended in token chunks.
const SCORES_FLOATS: usize = 64 << 20;
/// CUDA's limit on a grid's second and third dimensions.
const GRID_LIMIT: usize = 65_535;
/// Decode steps run as CUDA graphs up to this many tokens (padded to a power of two) and
/// positions seen (the scores' row length, a power of two from 128), one graph per shape.
pub const GRAPH_TOKENS: usize = 256;
const GRAPH_VISIBLE: usize = 1 << 16;

/// A step's buffers, grown to the largest step seen.
struct Buffers {
    tokens: usize,
    samples: usize,
    plan_len: usize,
    scores_len: usize,
    x: Buffer,
    /// A product's input, quantised: codes, block scales, block sums.
    aq: Buffer,
    ad: Buffer,
    asum: Buffer,
    qkv: Buffer,
    gate_up: Buffer,
    scores: Buffer,
    plan: Buffer,
    logits: Buffer,
    argmax: Buffer,
    /// Sampling with top-k: each row's k, then each row's temperature; the rows' best
    /// `[samples, TOP_K_MAX]` ids and logits.
    best_k: Buffer,
    best_ids: Buffer,
    best_logits: Buffer,
}

/// Device addresses of a quantised input.
#[derive(Clone, Copy)]
struct Quantised {
    q: u64,
    d: u64,
    s: u64,
}

pub struct Forward {
    gpu: Arc<dyn Gpu>,
    /// Recorded decode steps by (tokens, scores row length); off after a GPU fails to record.
    graphs: HashMap<(usize, usize), u64>,
    graphs_on: bool,
    pub weights: DeviceWeights,
    /// Per layer: (K, V), each `[slots, kv_dim]` f16.
    pub kv: Vec<(Buffer, Buffer)>,
    pub block_size: usize,
    buffers: Option<Buffers>,
    pub rope: Rope,
}

impl Forward {
    pub fn new(
        gpu: Arc<dyn Gpu>,
        weights: DeviceWeights,
        num_blocks: usize,
        block_size: usize,
    ) -> Result<Forward, String> {
        let p = &weights.params;
        let slot_bytes = block_size * p.kv_heads * p.head_dim * 2;
        let mut kv = Vec::with_capacity(p.layers);
        for _ in 0..p.layers {
            let layer_bytes = (num_blocks + 1) * slot_bytes;
            kv.push((
                Buffer::zeros(&gpu, layer_bytes)?,
                Buffer::zeros(&gpu, layer_bytes)?,
            ));
        }
        let rope = Rope {
            head_dim: p.head_dim,
            theta_scale: p.rope_theta.powf(-2.0 / p.head_dim as f32),
        };
        Ok(Forward {
            gpu,
            graphs: HashMap::new(),
            graphs_on: true,
            weights,
            kv,
            block_size,
            buffers: None,
            rope,
        })
    }

    /// Grows the step's buffers to hold `plan`'s step.
    fn reserve(&mut self, plan: &StepPlan, stride: usize) -> Result<(), String> {
        let l = plan.layout;
        let p = self.weights.params.clone();
        let scores_needed = (l.num_tokens * p.heads * stride).min(SCORES_FLOATS);
        if let Some(b) = &self.buffers {
            if l.num_tokens <= b.tokens
                && l.num_samples <= b.samples
                && l.len <= b.plan_len
                && scores_needed <= b.scores_len
            {
                return Ok(());
            }
        }
        // Recorded graphs hold the old buffers' addresses.
        self.drop_graphs();
        let old = self.buffers.take();
        let keep = |f: fn(&Buffers) -> usize| old.as_ref().map_or(0, f);
        let tokens = l.num_tokens.max(keep(|b| b.tokens)).next_power_of_two();
        let samples = l
            .num_samples
            .max(keep(|b| b.samples))
            .max(1)
            .next_power_of_two();
        let plan_len = l.len.max(keep(|b| b.plan_len)).next_power_of_two();
        let scores_len = scores_needed
            .max(keep(|b| b.scores_len))
            .next_power_of_two()
            .min(SCORES_FLOATS);
        drop(old);
        let q_dim = p.heads * p.head_dim;
        let kv_dim = p.kv_heads * p.head_dim;
        let widest = p.hidden.max(q_dim).max(p.ffn);
        let rows = tokens.max(samples);
        let floats = |n: usize| Buffer::zeros(&self.gpu, 4 * n);
        self.buffers = Some(Buffers {
            tokens,
            samples,
            plan_len,
            scores_len,
            x: floats(tokens * p.hidden)?,
            aq: Buffer::zeros(&self.gpu, rows * widest)?,
            ad: floats(rows * widest / 32)?,
            asum: floats(rows * widest / 32)?,
            qkv: floats(tokens * (q_dim + 2 * kv_dim))?,
            gate_up: floats(tokens * 2 * p.ffn)?,
            scores: floats(scores_len)?,
            plan: floats(plan_len)?,
            logits: floats(samples * p.vocab_size)?,
            argmax: floats(samples)?,
            best_k: floats(2 * samples)?,
            best_ids: floats(samples * TOP_K_MAX)?,
            best_logits: floats(samples * TOP_K_MAX)?,
        });
        Ok(())
    }

    /// `out[t, offset + n] (+)= W[n] · a[t]` for every part of `product`, over `k` inputs.
    fn product(
        &self,
        product: &Product,
        a: Quantised,
        k: usize,
        tokens: usize,
        out: u64,
        accumulate: bool,
    ) -> Result<(), String> {
        let grid_y = tokens.div_ceil(PRODUCT_TOKENS) as u32;
        let mut offset = 0;
        for part in &product.parts {
            let grid = (part.rows.div_ceil(PRODUCT_ROWS) as u32, grid_y, 1);
            self.gpu.launch(
                "matmul_q",
                grid,
                THREADS,
                &[
                    Arg::Ptr(part.qs.ptr()),
                    Arg::Ptr(part.d.ptr()),
                    Arg::Ptr(part.m.ptr()),
                    Arg::I32(part.kind),
                    Arg::I32(part.rows as i32),
                    Arg::I32(k as i32),
                    Arg::Ptr(a.q),
                    Arg::Ptr(a.d),
                    Arg::Ptr(a.s),
                    Arg::I32(tokens as i32),
                    Arg::Ptr(out + 4 * offset as u64),
                    Arg::I32(product.rows as i32),
                    Arg::I32(i32::from(accumulate)),
                ],
            )?;
            offset += part.rows;
        }
        Ok(())
    }

    /// The tokens a graph for a step of `shape` would take, when graphs serve such a step.
    pub fn graph_tokens(&self, shape: &StepShape) -> Option<usize> {
        (self.graphs_on
            && shape.decode_only
            && shape.num_tokens <= GRAPH_TOKENS
            && shape.max_visible <= GRAPH_VISIBLE)
            .then(|| shape.num_tokens.next_power_of_two())
    }

    /// Enqueues the step's pass; the logits of `plan`'s sample rows are in the logits buffer
    /// once the stream reaches the end. A decode step padded to [`Forward::graph_tokens`]
    /// replays a recorded graph (recorded the first time its shape comes).
    pub fn run(&mut self, plan: &StepPlan) -> Result<(), String> {
        let l = plan.layout;
        if l.num_tokens == 0 {
            return Ok(());
        }
        if l.num_tokens.div_ceil(PRODUCT_TOKENS) > GRID_LIMIT {
            return Err(format!("a step of {} tokens is too large", l.num_tokens));
        }
        if self.weights.params.heads * l.max_visible > SCORES_FLOATS {
            return Err(format!(
                "a token attends over {} positions: the attention scores buffer holds one row of at most {}",
                l.max_visible,
                SCORES_FLOATS / self.weights.params.heads
            ));
        }
        if self.graph_tokens(&plan.shape()) == Some(l.num_tokens) {
            let stride = l.max_visible.next_power_of_two().max(THREADS as usize);
            self.reserve(plan, stride)?;
            self.buffers()?.plan.write(0, &plan.packed)?;
            match self.replay(plan, stride) {
                Ok(()) => return Ok(()),
                Err(e) => {
                    tracing::warn!(error = %e, "CUDA graphs off: decode steps launch kernel by kernel");
                    self.graphs_on = false;
                    self.drop_graphs();
                }
            }
        }
        let stride = l.max_visible.max(1);
        self.reserve(plan, stride)?;
        self.buffers()?.plan.write(0, &plan.packed)?;
        self.enqueue(plan, stride)
    }

    /// Replays the graph of `plan`'s shape, recording it first if it is new.
    fn replay(&mut self, plan: &StepPlan, stride: usize) -> Result<(), String> {
        let key = (plan.layout.num_tokens, stride);
        if let Some(&graph) = self.graphs.get(&key) {
            return self.gpu.replay(graph);
        }
        self.gpu.begin_capture()?;
        let recorded = self.enqueue(plan, stride);
        let graph = self.gpu.end_capture();
        recorded?;
        let graph = graph?;
        self.graphs.insert(key, graph);
        self.gpu.replay(graph)
    }

    /// Decode-step shapes recorded as graphs so far (0 once a GPU failed to record).
    pub fn graphs(&self) -> usize {
        self.graphs.len()
    }

    fn drop_graphs(&mut self) {
        for (_, graph) in self.graphs.drain() {
            self.gpu.drop_graph(graph);
        }
    }

    /// Launches the pass over the uploaded plan, with attention scores in rows of `stride`.
    fn enqueue(&self, plan: &StepPlan, stride: usize) -> Result<(), String> {
        use Arg::{Ptr, F32, I32};
        let l = plan.layout;
        let b = self.buffers()?;
        let p = &self.weights.params;
        let w = &self.weights;
        let at = |offset: usize| Ptr(b.plan.at::<i32>(offset));
        let (tokens, slots, rope) = (at(l.tokens), at(l.slots), at(l.rope));
        let (table_start, visible, tables) = (at(l.table_start), at(l.visible), at(l.tables));
        let (order, sample_rows) = (at(l.order), at(l.sample_rows));
        let (x, qkv, gate_up, scores) = (
            Ptr(b.x.ptr()),
            Ptr(b.qkv.ptr()),
            Ptr(b.gate_up.ptr()),
            Ptr(b.scores.ptr()),
        );
        let a = Quantised {
            q: b.aq.ptr(),
            d: b.ad.ptr(),
            s: b.asum.ptr(),
        };
        let quantised = [Ptr(a.q), Ptr(a.d), Ptr(a.s)];
        let t = l.num_tokens;
        let grid_t = (t as u32, 1, 1);
        let (hidden, vocab, ffn) = (
            I32(p.hidden as i32),
            I32(p.vocab_size as i32),
            I32(p.ffn as i32),
        );
        let (heads, kv_heads) = (I32(p.heads as i32), I32(p.kv_heads as i32));
        let q_dim = p.heads * p.head_dim;
        let eps = F32(p.rms_eps);
        let block_size = I32(self.block_size as i32);
        let scale = F32(1.0 / (p.head_dim as f32).sqrt());
        let chunk = (SCORES_FLOATS / (p.heads * stride)).clamp(1, GRID_LIMIT);
        let no_rows = Ptr(0);
        let norm_q8 = |norm: &Buffer, rows: usize, which: Arg| {
            let mut args = vec![x, Ptr(norm.ptr()), which, hidden, eps];
            args.extend(quantised);
            self.gpu
                .launch("rms_norm_q8", (rows as u32, 1, 1), THREADS, &args)
        };
        self.gpu.launch(
            "embed",
            grid_t,
            256,
            &[Ptr(w.embed.ptr()), tokens, x, hidden, vocab],
        )?;
        for (layer, (k_cache, v_cache)) in w.layers.iter().zip(&self.kv) {
            let (k_cache, v_cache) = (Ptr(k_cache.ptr()), Ptr(v_cache.ptr()));
            norm_q8(&layer.attn_norm, t, no_rows)?;
            self.product(&layer.qkv, a, p.hidden, t, b.qkv.ptr(), false)?;
            self.gpu.launch(
                "rope_store",
                grid_t,
                THREADS,
                &[qkv, rope, slots, k_cache, v_cache, heads, kv_heads],
            )?;
            for first in (0..t).step_by(chunk) {
                let n = chunk.min(t - first) as u32;
                let (stride_i, token0) = (I32(stride as i32), I32(first as i32));
                let grid = (stride.div_ceil(THREADS as usize) as u32, p.heads as u32, n);
                self.gpu.launch(
                    "attn_scores",
                    grid,
                    THREADS,
                    &[
                        qkv,
                        k_cache,
                        tables,
                        table_start,
                        visible,
                        order,
                        scores,
                        heads,
                        kv_heads,
                        block_size,
                        stride_i,
                        scale,
                        token0,
                    ],
                )?;
                self.gpu.launch(
                    "attn_softmax",
                    (p.heads as u32, n, 1),
                    THREADS,
                    &[scores, visible, heads, stride_i, token0],
                )?;
                // The weighted values, quantised as the output product's input.
                let mut args = vec![
                    scores,
                    v_cache,
                    tables,
                    table_start,
                    visible,
                    order,
                    heads,
                    kv_heads,
                    block_size,
                    stride_i,
                    token0,
                ];
                args.extend(quantised);
                self.gpu
                    .launch("attn_pv", (n, p.heads as u32, 1), p.head_dim as u32, &args)?;
            }
            self.product(&layer.wo, a, q_dim, t, b.x.ptr(), true)?;
            norm_q8(&layer.ffn_norm, t, no_rows)?;
            self.product(&layer.gate_up, a, p.hidden, t, b.gate_up.ptr(), false)?;
            let mut args = vec![gate_up, ffn];
            args.extend(quantised);
            self.gpu.launch("silu_q8", grid_t, THREADS, &args)?;
            self.product(&layer.down, a, p.ffn, t, b.x.ptr(), true)?;
        }
        let n = l.num_samples;
        if n == 0 {
            return Ok(());
        }
        norm_q8(&w.output_norm, n, sample_rows)?;
        self.product(&w.head, a, p.hidden, n, b.logits.ptr(), false)
    }

    /// The step's logits rows, `[samples, vocab]`, copied to the host (waits for the step).
    pub fn logits(&self, samples: usize) -> Result<Vec<f32>, String> {
        self.buffers()?
            .logits
            .read(0, samples * self.weights.params.vocab_size)
    }

    /// Each row's best token, picked on the device (waits for the step).
    pub fn argmax(&self, samples: usize) -> Result<Vec<i32>, String> {
        let b = self.buffers()?;
        let vocab = Arg::I32(self.weights.params.vocab_size as i32);
        self.gpu.launch(
            "argmax",
            (samples as u32, 1, 1),
            THREADS,
            &[Arg::Ptr(b.logits.ptr()), vocab, Arg::Ptr(b.argmax.ptr())],
        )?;
        b.argmax.read(0, samples)
    }

    /// Each row's best `k` tokens at its temperature as (id, logit) pairs in no particular
    /// order, picked on the device (waits for the step). `choices`: (k ≤ TOP_K_MAX,
    /// temperature) per row; rows with k = 0 are skipped and come back empty.
    pub fn best(&self, choices: &[(usize, f32)]) -> Result<Vec<Vec<(u32, f32)>>, String> {
        let b = self.buffers()?;
        let vocab = self.weights.params.vocab_size;
        let ks: Vec<i32> = choices.iter().map(|c| c.0.min(vocab) as i32).collect();
        let temperatures: Vec<f32> = choices.iter().map(|c| c.1).collect();
        if ks.iter().any(|&k| k as usize > TOP_K_MAX) {
            return Err(format!("top-k over {TOP_K_MAX} is sampled on the host"));
        }
        let rows = choices.len();
        b.best_k.write(0, &ks)?;
        b.best_k.write(rows, &temperatures)?;
        self.gpu.launch(
            "top_k",
            (rows as u32, 1, 1),
            THREADS,
            &[
                Arg::Ptr(b.logits.ptr()),
                Arg::I32(vocab as i32),
                Arg::Ptr(b.best_k.ptr()),
                Arg::Ptr(b.best_k.at::<f32>(rows)),
                Arg::Ptr(b.best_ids.ptr()),
                Arg::Ptr(b.best_logits.ptr()),
            ],
        )?;
        let ids: Vec<i32> = b.best_ids.read(0, rows * TOP_K_MAX)?;
        let logits: Vec<f32> = b.best_logits.read(0, rows * TOP_K_MAX)?;
        Ok(ks
            .iter()
            .enumerate()
            .map(|(row, &k)| {
                let at = row * TOP_K_MAX;
                (at..at + k as usize)
                    .map(|i| (ids[i] as u32, logits[i]))
                    .collect()
            })
            .collect())
    }

    /// Waits for everything enqueued.
    pub fn synchronize(&self) -> Result<(), String> {
        self.gpu.synchronize()
    }

    pub fn gpu(&self) -> &Arc<dyn Gpu> {
        &self.gpu
    }

    fn buffers(&self) -> Result<&Buffers, String> {
        self.buffers
            .as_ref()
            .ok_or_else(|| "no step has run".to_string())
    }
}

impl Drop for Forward {
    fn drop(&mut self) {
        self.drop_graphs();
    }
}
