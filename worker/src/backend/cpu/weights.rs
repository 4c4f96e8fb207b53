//! The model's weights, read from the GGUF file. Quantised matrices stay in their ggml block
//! format (the kernels work on it directly); float matrices become f32; norms become f32.
//!
//! Q/K row layout: llama.cpp's converter permutes the rows of the Q and K projections so that
//! GGUF Llama weights expect *interleaved* RoPE (rotating pairs `(x[2i], x[2i+1])`) rather than
//! Hugging Face's split-half layout. kvgate keeps the rows as stored and applies interleaved
//! RoPE (`forward.rs`), which is equivalent; split-half RoPE on these rows would be the classic
//! silent bug that only shows at longer context.

use super::quant::{dequantize_row, WeightType, QK};
use crate::model::gguf::{Gguf, TensorInfo};
use crate::model::LlamaParams;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum WeightError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("tensor `{0}` is missing")]
    Missing(String),
    #[error("tensor `{name}` has ggml type {type_id}, which kvgate does not support (F32, F16, BF16, Q8_0, Q4_0 and Q4_1 are)")]
    UnsupportedType { name: String, type_id: u32 },
    #[error("tensor `{name}` has dimensions {dims:?}, expected {expected:?}")]
    Shape {
        name: String,
        dims: Vec<u64>,
        expected: Vec<u64>,
    },
    #[error("tensor `{name}` lies outside the file (ends at byte {end}, the file has {len})")]
    OutOfFile { name: String, end: u64, len: u64 },
    #[error("the model is not usable: {0}")]
    Params(String),
}

/// A weight matrix: `rows` outputs, each a dot product over `cols` inputs.
#[derive(Debug, Clone)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub data: MatrixData,
}

#[derive(Debug, Clone)]
pub enum MatrixData {
    /// Rows of ggml blocks (Q8_0, Q4_0 or Q4_1), with every block's scale `d` (and Q4_1's
    /// offset `m`) also decoded to f32, `rows * cols / 32` of each, so that the kernels do not
    /// convert f16 in their inner loop.
    Quantized {
        kind: WeightType,
        bytes: Vec<u8>,
        row_bytes: usize,
        d: Vec<f32>,
        m: Vec<f32>,
    },
    F32(Vec<f32>),
}

impl Matrix {
    /// Row `r` decoded to f32 (embedding lookup).
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        match &self.data {
            MatrixData::Quantized {
                kind,
                bytes,
                row_bytes,
                ..
            } => dequantize_row(*kind, &bytes[r * row_bytes..(r + 1) * row_bytes], out),
            MatrixData::F32(v) => out.copy_from_slice(&v[r * self.cols..(r + 1) * self.cols]),
        }
    }
}

pub struct Layer {
    pub attn_norm: Vec<f32>,
    pub wq: Matrix,
    pub wk: Matrix,
    pub wv: Matrix,
    pub wo: Matrix,
    pub ffn_norm: Vec<f32>,
    pub w_gate: Matrix,
    pub w_up: Matrix,
    pub w_down: Matrix,
}

pub struct Weights {
    pub params: LlamaParams,
    pub embed: Matrix,
    pub layers: Vec<Layer>,
    pub output_norm: Vec<f32>,
    /// `None` when the embedding is tied (the output head is `embed`).
    pub output: Option<Matrix>,
}

impl Weights {
    pub fn head(&self) -> &Matrix {
        self.output.as_ref().unwrap_or(&self.embed)
    }

    /// Bytes of weights read per token at batch 1 (every matrix once, the head included, but
    /// one embedding row rather than the whole table).
    pub fn bytes_per_token(&self) -> usize {
        let size = |m: &Matrix| match &m.data {
            MatrixData::Quantized { bytes, .. } => bytes.len(),
            MatrixData::F32(v) => v.len() * 4,
        };
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down]
                    .into_iter()
                    .map(size)
                    .sum::<usize>()
            })
            .sum();
        layers + size(self.head())
    }

    pub fn load(path: &Path, gguf: &Gguf, params: &LlamaParams) -> Result<Weights, WeightError> {
        let io = |source| WeightError::Io {
            path: path.display().to_string(),
            source,
        };
        let mut file = std::fs::File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        if params.heads == 0
            || params.kv_heads == 0
            || !params.heads.is_multiple_of(params.kv_heads)
            || !params.head_dim.is_multiple_of(2)
        {
            return Err(WeightError::Params(format!(
                "{} heads over {} KV heads of dimension {}",
                params.heads, params.kv_heads, params.head_dim
            )));
        }
        let mut reader = TensorReader {
            file: &mut file,
            gguf,
            len,
            path,
        };
        let (h, hd) = (params.hidden as u64, params.head_dim as u64);
        let q_dim = params.heads as u64 * hd;
        let kv_dim = params.kv_heads as u64 * hd;
        let ffn = params.ffn as u64;
        let vocab = params.vocab_size as u64;
        let mut layers = Vec::with_capacity(params.layers);
        for i in 0..params.layers {
            let name = |t: &str| format!("blk.{i}.{t}.weight");
            layers.push(Layer {
                attn_norm: reader.vector(&name("attn_norm"), h)?,
                wq: reader.matrix(&name("attn_q"), h, q_dim)?,
                wk: reader.matrix(&name("attn_k"), h, kv_dim)?,
                wv: reader.matrix(&name("attn_v"), h, kv_dim)?,
                wo: reader.matrix(&name("attn_output"), q_dim, h)?,
                ffn_norm: reader.vector(&name("ffn_norm"), h)?,
                w_gate: reader.matrix(&name("ffn_gate"), h, ffn)?,
                w_up: reader.matrix(&name("ffn_up"), h, ffn)?,
                w_down: reader.matrix(&name("ffn_down"), ffn, h)?,
            });
        }
        let output = match gguf.tensor("output.weight") {
            Some(_) => Some(reader.matrix("output.weight", h, vocab)?),
            None => None,
        };
        Ok(Weights {
            params: params.clone(),
            embed: reader.matrix("token_embd.weight", h, vocab)?,
            layers,
            output_norm: reader.vector("output_norm.weight", h)?,
            output,
        })
    }
}

/// Every block's scale `d` and (Q4_1) offset `m` as f32.
pub fn block_scales(kind: WeightType, bytes: &[u8]) -> (Vec<f32>, Vec<f32>) {
    let size = kind.row_bytes(QK);
    let half =
        |b: &[u8], at: usize| half::f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32();
    let d = bytes.chunks_exact(size).map(|b| half(b, 0)).collect();
    let m = if kind == WeightType::Q4_1 {
        bytes.chunks_exact(size).map(|b| half(b, 2)).collect()
    } else {
        Vec::new()
    };
    (d, m)
}

struct TensorReader<'a> {
    file: &'a mut std::fs::File,
    gguf: &'a Gguf,
    len: u64,
    path: &'a Path,
}

impl TensorReader<'_> {
    fn info(&self, name: &str, expected: &[u64]) -> Result<(TensorInfo, WeightType), WeightError> {
        let t = self
            .gguf
            .tensor(name)
            .ok_or_else(|| WeightError::Missing(name.to_string()))?
            .clone();
        if t.dims != expected {
            return Err(WeightError::Shape {
                name: name.into(),
                dims: t.dims,
                expected: expected.to_vec(),
            });
        }
        let kind =
            WeightType::from_ggml(t.ggml_type).ok_or_else(|| WeightError::UnsupportedType {
                name: name.into(),
                type_id: t.ggml_type,
            })?;
        if kind.is_blocked() && !expected[0].is_multiple_of(QK as u64) {
            return Err(WeightError::Shape {
                name: name.into(),
                dims: t.dims,
                expected: expected.to_vec(),
            });
        }
        Ok((t, kind))
    }

    fn bytes(&mut self, t: &TensorInfo, size: u64) -> Result<Vec<u8>, WeightError> {
        let start = self.gguf.data_offset + t.offset;
        let end = start.saturating_add(size);
        if end > self.len {
            return Err(WeightError::OutOfFile {
                name: t.name.clone(),
                end,
                len: self.len,
            });
        }
        let io = |source| WeightError::Io {
            path: self.path.display().to_string(),
            source,
        };
        self.file.seek(SeekFrom::Start(start)).map_err(io)?;
        let mut buf = vec![0u8; size as usize];
        self.file.read_exact(&mut buf).map_err(io)?;
        Ok(buf)
    }

    /// A `[cols, rows]` tensor (ggml order) as a matrix of `rows` outputs.
    fn matrix(&mut self, name: &str, cols: u64, rows: u64) -> Result<Matrix, WeightError> {
        let (t, kind) = self.info(name, &[cols, rows])?;
        let row_bytes = kind.row_bytes(cols as usize);
        let bytes = self.bytes(&t, row_bytes as u64 * rows)?;
        let (rows, cols) = (rows as usize, cols as usize);
        let data = if kind.is_blocked() {
            let (d, m) = block_scales(kind, &bytes);
            MatrixData::Quantized {
                kind,
                bytes,
                row_bytes,
                d,
                m,
            }
        } else {
            let mut out = vec![0f32; rows * cols];
            for (r, o) in out.chunks_exact_mut(cols).enumerate() {
                dequantize_row(kind, &bytes[r * row_bytes..(r + 1) * row_bytes], o);
            }
            MatrixData::F32(out)
        };
        Ok(Matrix { rows, cols, data })
    }

    fn vector(&mut self, name: &str, len: u64) -> Result<Vec<f32>, WeightError> {
        let (t, kind) = self.info(name, &[len])?;
        if kind.is_blocked() {
            return Err(WeightError::UnsupportedType {
                name: name.into(),
                type_id: t.ggml_type,
            });
        }
        let bytes = self.bytes(&t, kind.row_bytes(len as usize) as u64)?;
        let mut out = vec![0f32; len as usize];
        dequantize_row(kind, &bytes, &mut out);
        Ok(out)
    }
}
