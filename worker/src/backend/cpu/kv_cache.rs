//! The paged KV cache: per layer, K and V for every slot of every block. Values are rounded to
//! f16 on write, as llama.cpp stores them by default, but kept as f32 so that attention reads
//! them without converting (twice the memory of f16, no conversion in the inner loop).

use half::f16;

pub struct KvCache {
    block_size: usize,
    kv_dim: usize,
    /// Per layer: (K, V), each `(num_blocks + 1) * block_size * kv_dim` (block 0 is the null
    /// block and never written).
    layers: Vec<(Vec<f32>, Vec<f32>)>,
}

impl KvCache {
    pub fn new(layers: usize, num_blocks: usize, block_size: usize, kv_dim: usize) -> KvCache {
        let size = (num_blocks + 1) * block_size * kv_dim;
        KvCache {
            block_size,
            kv_dim,
            layers: (0..layers)
                .map(|_| (vec![0.0; size], vec![0.0; size]))
                .collect(),
        }
    }

    /// Bytes per token of cache (K and V, all layers, f32).
    pub fn bytes_per_token(layers: usize, kv_dim: usize) -> usize {
        layers * 2 * kv_dim * 4
    }

    /// Offset of position `pos`'s vector, or `None` if the block table does not reach it.
    pub fn offset(&self, block_table: &[u32], pos: usize) -> Option<usize> {
        let block = *block_table.get(pos / self.block_size)? as usize;
        Some((block * self.block_size + pos % self.block_size) * self.kv_dim)
    }

    pub fn write(&mut self, layer: usize, offset: usize, k: &[f32], v: &[f32]) {
        let (ks, vs) = &mut self.layers[layer];
        for (dst, src) in ks[offset..offset + self.kv_dim].iter_mut().zip(k) {
            *dst = f16::from_f32(*src).to_f32();
        }
        for (dst, src) in vs[offset..offset + self.kv_dim].iter_mut().zip(v) {
            *dst = f16::from_f32(*src).to_f32();
        }
    }

    pub fn layer(&self, layer: usize) -> (&[f32], &[f32]) {
        let (k, v) = &self.layers[layer];
        (k, v)
    }
}
