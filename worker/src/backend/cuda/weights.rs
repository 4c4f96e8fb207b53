//! The model's weights on the device, in the ggml block formats the CPU backend reads, so
//! that the device's integer products give the CPU's bits: per block the quantised values
//! (16 bytes of nibbles for Q4_0/Q4_1, 32 codes for Q8_0) packed apart from the scales, which
//! go as f32 (`d`, and Q4_1's offset `m`). Q/K/V and gate/up are each fused into one matrix
//! when they share a format (one product instead of three or two). Norms and the embedding
//! table are f32 (a token's row is looked up exactly).

use super::gpu::{Buffer, Gpu};
use crate::backend::cpu::quant::{WeightType, QK};
use crate::backend::cpu::weights::{Matrix, MatrixData, Weights};
use crate::model::LlamaParams;
use std::sync::Arc;

/// A quantised matrix of `rows` outputs over `cols` inputs.
pub struct DeviceMatrix {
    /// The ggml type id the kernels switch on (2 Q4_0, 3 Q4_1, 8 Q8_0).
    pub kind: i32,
    pub rows: usize,
    pub qs: Buffer,
    pub d: Buffer,
    /// Q4_1 only (one placeholder value otherwise).
    pub m: Buffer,
}

/// One or more matrices over the same input whose outputs lie side by side.
pub struct Product {
    pub parts: Vec<DeviceMatrix>,
    /// Outputs of all the parts together.
    pub rows: usize,
}

pub struct DeviceLayer {
    pub attn_norm: Buffer,
    /// Q's outputs, then K's, then V's.
    pub qkv: Product,
    pub wo: Product,
    pub ffn_norm: Buffer,
    /// Gate's outputs, then up's.
    pub gate_up: Product,
    pub down: Product,
}

pub struct DeviceWeights {
    pub params: LlamaParams,
    pub embed: Buffer,
    pub head: Product,
    pub output_norm: Buffer,
    pub layers: Vec<DeviceLayer>,
    /// Bytes of the matrices a decode step reads (each once, the head included).
    pub bytes_per_step: usize,
}

fn kind_id(kind: WeightType) -> Option<i32> {
    match kind {
        WeightType::Q4_0 => Some(2),
        WeightType::Q4_1 => Some(3),
        WeightType::Q8_0 => Some(8),
        _ => None,
    }
}

/// Quantised values of each block, without the block's scale header.
fn block_values(kind: WeightType, bytes: &[u8]) -> Vec<u8> {
    let size = kind.row_bytes(QK);
    // f16 scale `d`, and Q4_1's f16 offset `m`.
    let header = if kind == WeightType::Q4_1 { 4 } else { 2 };
    bytes
        .chunks_exact(size)
        .flat_map(|b| b[header..].iter().copied())
        .collect()
}

/// A quantised matrix on the host, laid out as the device takes it.
struct HostMatrix {
    kind: WeightType,
    rows: usize,
    cols: usize,
    qs: Vec<u8>,
    d: Vec<f32>,
    m: Vec<f32>,
}

/// `matrices` fused into one when they share a format, else each on its own.
pub fn product(gpu: &Arc<dyn Gpu>, name: &str, matrices: &[&Matrix]) -> Result<Product, String> {
    let mut parts: Vec<HostMatrix> = Vec::new();
    for m in matrices {
        let MatrixData::Quantized {
            kind,
            bytes,
            d,
            m: offsets,
            ..
        } = &m.data
        else {
            return Err(format!(
                "{name}: the cuda backend takes Q4_0, Q4_1 and Q8_0 matrices, not float ones"
            ));
        };
        if kind_id(*kind).is_none() {
            return Err(format!(
                "{name}: {kind:?} matrices are not supported on cuda"
            ));
        }
        let qs = block_values(*kind, bytes);
        match parts.last_mut() {
            Some(last) if last.kind == *kind && last.cols == m.cols => {
                last.rows += m.rows;
                last.qs.extend(qs);
                last.d.extend(d);
                last.m.extend(offsets);
            }
            _ => parts.push(HostMatrix {
                kind: *kind,
                rows: m.rows,
                cols: m.cols,
                qs,
                d: d.clone(),
                m: offsets.clone(),
            }),
        }
    }
    let rows = parts.iter().map(|p| p.rows).sum();
    let parts = parts
        .into_iter()
        .map(|h| {
            Ok(DeviceMatrix {
                kind: kind_id(h.kind).unwrap_or_default(),
                rows: h.rows,
                qs: Buffer::from(gpu, &h.qs)?,
                d: Buffer::from(gpu, &h.d)?,
                m: Buffer::from(gpu, if h.m.is_empty() { &[0.0] } else { &h.m })?,
            })
        })
        .collect::<Result<_, String>>()?;
    Ok(Product { parts, rows })
}

fn f32_rows(m: &Matrix) -> Vec<f32> {
    let mut out = vec![0f32; m.rows * m.cols];
    for (r, row) in out.chunks_exact_mut(m.cols).enumerate() {
        m.row_f32(r, row);
    }
    out
}

fn bytes(m: &Matrix) -> usize {
    match &m.data {
        MatrixData::Quantized { bytes, .. } => bytes.len(),
        MatrixData::F32(v) => v.len() * 4,
    }
}

impl DeviceWeights {
    pub fn upload(gpu: &Arc<dyn Gpu>, w: &Weights) -> Result<DeviceWeights, String> {
        let p = &w.params;
        for (what, n) in [("hidden size", p.hidden), ("feed-forward size", p.ffn)] {
            if !n.is_multiple_of(QK) {
                return Err(format!("{what} {n} is not a multiple of {QK}"));
            }
        }
        let mut layers = Vec::with_capacity(w.layers.len());
        let mut bytes_per_step = bytes(w.head());
        for (i, l) in w.layers.iter().enumerate() {
            let name = |t: &str| format!("blk.{i}.{t}");
            bytes_per_step += [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down]
                .into_iter()
                .map(bytes)
                .sum::<usize>();
            layers.push(DeviceLayer {
                attn_norm: Buffer::from(gpu, &l.attn_norm)?,
                qkv: product(gpu, &name("attn_qkv"), &[&l.wq, &l.wk, &l.wv])?,
                wo: product(gpu, &name("attn_output"), &[&l.wo])?,
                ffn_norm: Buffer::from(gpu, &l.ffn_norm)?,
                gate_up: product(gpu, &name("ffn_gate_up"), &[&l.w_gate, &l.w_up])?,
                down: product(gpu, &name("ffn_down"), &[&l.w_down])?,
            });
        }
        Ok(DeviceWeights {
            params: p.clone(),
            embed: Buffer::from(gpu, &f32_rows(&w.embed))?,
            head: product(gpu, "output", &[w.head()])?,
            output_norm: Buffer::from(gpu, &w.output_norm)?,
            layers,
            bytes_per_step,
        })
    }
}
