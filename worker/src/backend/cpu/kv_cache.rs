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

    /// Bytes of one block as [`KvCache::export`] writes it: K then V of every layer, f16.
    pub fn block_bytes(&self) -> usize {
        self.layers.len() * 2 * self.block_size * self.kv_dim * 2
    }

    /// Block `block`'s K/V as f16, little-endian: every value was rounded to f16 on write, so
    /// nothing is lost. `None` for a block outside the cache.
    pub fn export(&self, block: usize) -> Option<Vec<u8>> {
        let range = self.block_range(block)?;
        let mut out = Vec::with_capacity(self.block_bytes());
        for (k, v) in &self.layers {
            for &x in k[range.clone()].iter().chain(&v[range.clone()]) {
                out.extend_from_slice(&f16::from_f32(x).to_le_bytes());
            }
        }
        Some(out)
    }

    /// Writes bytes from [`KvCache::export`] into block `block`.
    pub fn import(&mut self, block: usize, data: &[u8]) -> Result<(), String> {
        if data.len() != self.block_bytes() {
            return Err(format!(
                "a block holds {} bytes here, not {}",
                self.block_bytes(),
                data.len()
            ));
        }
        let range = self
            .block_range(block)
            .ok_or_else(|| format!("no block {block} in this cache"))?;
        let mut values = data
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32());
        for (k, v) in &mut self.layers {
            for dst in k[range.clone()].iter_mut().chain(&mut v[range.clone()]) {
                *dst = values.next().unwrap_or_default();
            }
        }
        Ok(())
    }

    /// Where block `block`'s values lie in each layer's K (and V); never the null block.
    fn block_range(&self, block: usize) -> Option<std::ops::Range<usize>> {
        let per_block = self.block_size * self.kv_dim;
        let start = block * per_block;
        let len = self.layers.first().map_or(0, |(k, _)| k.len());
        (block > 0 && start + per_block <= len).then(|| start..start + per_block)
    }

    pub fn layer(&self, layer: usize) -> (&[f32], &[f32]) {
        let (k, v) = &self.layers[layer];
        (k, v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_exported_and_imported_elsewhere_holds_the_same_values() {
        let mut cache = KvCache::new(2, 3, 4, 8);
        let table = [2];
        for pos in 0..4 {
            let k: Vec<f32> = (0..8).map(|i| (pos * 8 + i) as f32 * 0.1 - 1.3).collect();
            let v: Vec<f32> = k.iter().map(|x| x * -3.7).collect();
            for layer in 0..2 {
                let offset = cache.offset(&table, pos).unwrap();
                cache.write(layer, offset, &k, &v);
            }
        }
        let data = cache.export(2).unwrap();
        assert_eq!(data.len(), cache.block_bytes());
        cache.import(3, &data).unwrap();
        assert_eq!(cache.export(3).unwrap(), data);
        let rows = |b: usize| b * 4 * 8..(b + 1) * 4 * 8;
        for layer in 0..2 {
            let (k, v) = cache.layer(layer);
            assert_eq!(k[rows(2)], k[rows(3)]);
            assert_eq!(v[rows(2)], v[rows(3)]);
        }
    }

    #[test]
    fn the_null_block_a_block_out_of_range_and_a_wrong_size_are_refused() {
        let mut cache = KvCache::new(1, 2, 4, 8);
        assert!(cache.export(0).is_none() && cache.export(3).is_none());
        let data = cache.export(1).unwrap();
        assert!(cache.import(1, &data[1..]).is_err());
        assert!(cache.import(0, &data).is_err());
        assert!(cache.import(3, &data).is_err());
    }
}
