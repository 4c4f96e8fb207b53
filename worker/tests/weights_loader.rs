//! Loading weights from GGUF files that are wrong in every way a file can be: each gives a
//! clear error naming the tensor, never a panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvgate_worker::backend::cpu::weights::{WeightError, Weights};
use kvgate_worker::model::gguf::Gguf;
use kvgate_worker::model::LlamaParams;

const HIDDEN: u64 = 32;
const FFN: u64 = 64;
const VOCAB: u64 = 8;

/// A one-layer Llama with F32 tensors; `edit` may change a tensor's (dims, type) by name.
fn model_file(edit: impl Fn(&str, &mut Vec<u64>, &mut u32)) -> Vec<u8> {
    let mut meta: Vec<u8> = Vec::new();
    let s = |b: &mut Vec<u8>, v: &str| {
        b.extend_from_slice(&(v.len() as u64).to_le_bytes());
        b.extend_from_slice(v.as_bytes());
    };
    let mut entries = 0u64;
    let mut kv_u32 = |b: &mut Vec<u8>, k: &str, v: u32| {
        s(b, k);
        b.extend_from_slice(&4u32.to_le_bytes());
        b.extend_from_slice(&v.to_le_bytes());
        entries += 1;
    };
    for (k, v) in [
        ("llama.block_count", 1),
        ("llama.embedding_length", HIDDEN as u32),
        ("llama.feed_forward_length", FFN as u32),
        ("llama.attention.head_count", 2),
        ("llama.attention.head_count_kv", 1),
        ("llama.context_length", 64),
        ("llama.vocab_size", VOCAB as u32),
    ] {
        kv_u32(&mut meta, k, v);
    }
    s(&mut meta, "general.architecture");
    meta.extend_from_slice(&8u32.to_le_bytes());
    s(&mut meta, "llama");
    entries += 1;
    let tensors: Vec<(String, Vec<u64>)> = [
        ("token_embd.weight".to_string(), vec![HIDDEN, VOCAB]),
        ("output_norm.weight".to_string(), vec![HIDDEN]),
        ("blk.0.attn_norm.weight".to_string(), vec![HIDDEN]),
        ("blk.0.attn_q.weight".to_string(), vec![HIDDEN, HIDDEN]),
        ("blk.0.attn_k.weight".to_string(), vec![HIDDEN, HIDDEN / 2]),
        ("blk.0.attn_v.weight".to_string(), vec![HIDDEN, HIDDEN / 2]),
        ("blk.0.attn_output.weight".to_string(), vec![HIDDEN, HIDDEN]),
        ("blk.0.ffn_norm.weight".to_string(), vec![HIDDEN]),
        ("blk.0.ffn_gate.weight".to_string(), vec![HIDDEN, FFN]),
        ("blk.0.ffn_up.weight".to_string(), vec![HIDDEN, FFN]),
        ("blk.0.ffn_down.weight".to_string(), vec![FFN, HIDDEN]),
    ]
    .into_iter()
    .collect();
    let mut out = Vec::new();
    out.extend_from_slice(b"GGUF");
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    out.extend_from_slice(&entries.to_le_bytes());
    out.extend_from_slice(&meta);
    let mut offset = 0u64;
    let mut data_len = 0u64;
    for (name, dims) in &tensors {
        let (mut dims, mut kind) = (dims.clone(), 0u32);
        edit(name, &mut dims, &mut kind);
        s(&mut out, name);
        out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
        for d in &dims {
            out.extend_from_slice(&d.to_le_bytes());
        }
        out.extend_from_slice(&kind.to_le_bytes());
        out.extend_from_slice(&offset.to_le_bytes());
        // An absurd tensor gets no data (the file would be terabytes).
        let bytes = dims.iter().product::<u64>().saturating_mul(4).min(1 << 20);
        offset += bytes.div_ceil(32) * 32;
        data_len = offset;
    }
    while out.len() % 32 != 0 {
        out.push(0);
    }
    out.resize(out.len() + data_len as usize, 0x3c); // every f32 = 0.0117...
    out
}

fn load(bytes: &[u8]) -> Result<Weights, WeightError> {
    // Tests run in parallel: every file gets its own name.
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = std::env::temp_dir().join(format!("kvgate-weights-{}-{n}.gguf", std::process::id()));
    std::fs::write(&path, bytes).unwrap();
    let gguf = Gguf::open(&path).unwrap();
    let params = LlamaParams::from_gguf(&gguf).unwrap();
    let result = Weights::load(&path, &gguf, &params);
    std::fs::remove_file(&path).ok();
    result
}

#[test]
fn a_valid_small_model_loads() {
    let w = load(&model_file(|_, _, _| {})).unwrap();
    assert_eq!(w.layers.len(), 1);
    assert!(w.output.is_none(), "tied embeddings");
}

#[test]
fn an_unsupported_type_names_the_tensor_and_the_type() {
    let e = load(&model_file(|name, _, kind| {
        if name == "blk.0.ffn_up.weight" {
            *kind = 12; // Q4_K
        }
    }))
    .err()
    .unwrap();
    let msg = e.to_string();
    assert!(
        matches!(e, WeightError::UnsupportedType { type_id: 12, .. }),
        "{msg}"
    );
    assert!(
        msg.contains("blk.0.ffn_up.weight") && msg.contains("12"),
        "{msg}"
    );
}

#[test]
fn wrong_shapes_and_missing_or_truncated_data_are_reported() {
    let e = load(&model_file(|name, dims, _| {
        if name == "blk.0.attn_q.weight" {
            dims[1] = 31;
        }
    }))
    .err()
    .unwrap();
    assert!(
        matches!(e, WeightError::Shape { .. }) && e.to_string().contains("attn_q"),
        "{e}"
    );

    let full = model_file(|_, _, _| {});
    let e = load(&full[..full.len() - 100]).err().unwrap();
    assert!(matches!(e, WeightError::OutOfFile { .. }), "{e}");

    let e = load(&model_file(|name, dims, _| {
        if name == "blk.0.ffn_down.weight" {
            dims.clear();
            dims.push(1 << 20);
            dims.push(1 << 20);
        }
    }))
    .err()
    .unwrap();
    assert!(
        matches!(e, WeightError::Shape { .. }),
        "absurd dimensions: {e}"
    );
}
