//! Prefix hashes of a long prompt, as the gateway computes them for every request and the
//! worker for every sequence: token mode's block hashes of a 16k-token prompt in blocks of 16,
//! and text mode's chunk hashes of 64 KB in chunks of 256 bytes.
//! Run: `cargo bench -p kvgate-protocol --bench hash`.

use criterion::{criterion_group, criterion_main, Criterion};
use kvgate_protocol::{block_hashes, text_chunk_hashes, HashSeed};
use std::hint::black_box;

fn hash(c: &mut Criterion) {
    let seed = HashSeed::new("bench", None, "");
    let tokens: Vec<u32> = (0..16_384u32)
        .map(|i| i.wrapping_mul(2_654_435_761) % 49_152)
        .collect();
    c.bench_function("block_hashes/16k_tokens", |b| {
        b.iter(|| block_hashes(seed, black_box(&tokens), 16))
    });
    let text: Vec<u8> = (0..65_536u32).map(|i| b'a' + (i % 26) as u8).collect();
    c.bench_function("text_chunk_hashes/64KB", |b| {
        b.iter(|| text_chunk_hashes(seed, black_box(&text), 256))
    });
}

criterion_group!(benches, hash);
criterion_main!(benches);
