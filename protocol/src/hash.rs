//! Prefix identity.
//!
//! A prompt is cut into full blocks (of token ids, or of bytes in text mode). Block `i`'s hash is
//! xxh3-64 over the block's little-endian contents, seeded with block `i - 1`'s hash; block 0 is
//! seeded with a [`HashSeed`] derived from the model, the adapter and a salt. So two prompts
//! share a hash at position `i` exactly when they share blocks `0..=i` (up to 64-bit
//! collisions), and changing any block changes every later hash. A trailing partial block has
//! no hash: only full blocks can be cached and shared.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// The seed of a hash chain: prompts only share blocks within one (model, adapter, salt).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HashSeed(pub u64);

impl HashSeed {
    /// Derives the seed from its parts. Each part is length-prefixed, so ("ab", "c") and
    /// ("a", "bc") give different seeds.
    pub fn new(model: &str, adapter: Option<&str>, salt: &str) -> Self {
        let adapter = adapter.unwrap_or("");
        let mut bytes = Vec::with_capacity(model.len() + adapter.len() + salt.len() + 24);
        for part in [model, adapter, salt] {
            bytes.extend_from_slice(&(part.len() as u64).to_le_bytes());
            bytes.extend_from_slice(part.as_bytes());
        }
        HashSeed(xxh3_64(&bytes))
    }
}

/// Hashes of the full `block_size`-token blocks of `tokens` (token mode).
/// `block_size` of zero yields no blocks.
pub fn block_hashes(seed: HashSeed, tokens: &[u32], block_size: usize) -> Vec<u64> {
    let mut hashes = Vec::with_capacity(tokens.len() / block_size.max(1));
    extend_block_hashes(seed, tokens, block_size, &mut hashes);
    hashes
}

/// Appends the hashes of the full blocks of `tokens` that `hashes` does not cover yet, for a
/// sequence that grows (a request's prompt, then its output).
pub fn extend_block_hashes(
    seed: HashSeed,
    tokens: &[u32],
    block_size: usize,
    hashes: &mut Vec<u64>,
) {
    if block_size == 0 || tokens.len() / block_size <= hashes.len() {
        return;
    }
    // One buffer, written in place: a copy the compiler turns into a plain memcpy on
    // little-endian machines.
    let mut buf = vec![0u8; block_size * 4];
    let mut prev = hashes.last().copied().unwrap_or(seed.0);
    for block in tokens.chunks_exact(block_size).skip(hashes.len()) {
        for (bytes, t) in buf.chunks_exact_mut(4).zip(block) {
            bytes.copy_from_slice(&t.to_le_bytes());
        }
        prev = xxh3_64_with_seed(&buf, prev);
        hashes.push(prev);
    }
}

/// Passes a u64 key through unchanged: for maps keyed by these hashes, which need no rehash.
#[derive(Debug, Default, Clone, Copy)]
pub struct PassThroughHasher(u64);

impl std::hash::Hasher for PassThroughHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only u64 keys are expected; fold anything else in so it still works.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, key: u64) {
        self.0 = key;
    }
}

/// A map keyed by a block or chunk hash.
pub type HashKeyMap<V> =
    std::collections::HashMap<u64, V, std::hash::BuildHasherDefault<PassThroughHasher>>;

/// Hashes of the full `chunk_bytes`-byte chunks of `text` (text mode, for engines whose token
/// hashes we cannot reproduce). `chunk_bytes` of zero yields no chunks.
pub fn text_chunk_hashes(seed: HashSeed, text: &[u8], chunk_bytes: usize) -> Vec<u64> {
    if chunk_bytes == 0 {
        return Vec::new();
    }
    let mut prev = seed.0;
    text.chunks_exact(chunk_bytes)
        .map(|chunk| {
            prev = xxh3_64_with_seed(chunk, prev);
            prev
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const SEED: HashSeed = HashSeed(7);

    #[test]
    fn only_full_blocks_are_hashed() {
        assert_eq!(block_hashes(SEED, &[1; 33], 16).len(), 2);
        assert!(block_hashes(SEED, &[1; 15], 16).is_empty());
        assert!(block_hashes(SEED, &[1; 15], 0).is_empty());
        assert_eq!(text_chunk_hashes(SEED, &[0; 512], 256).len(), 2);
    }

    #[test]
    fn extending_matches_hashing_at_once() {
        let tokens: Vec<u32> = (0..100).collect();
        let mut grown = Vec::new();
        for end in [10, 40, 41, 100] {
            extend_block_hashes(SEED, &tokens[..end], 16, &mut grown);
        }
        assert_eq!(grown, block_hashes(SEED, &tokens, 16));
    }

    #[test]
    fn seed_separates_models_adapters_and_salts() {
        let a = HashSeed::new("m", None, "");
        assert_ne!(a, HashSeed::new("m", Some("lora"), ""));
        assert_ne!(a, HashSeed::new("m2", None, ""));
        assert_ne!(a, HashSeed::new("m", None, "salt"));
        assert_ne!(
            HashSeed::new("ab", Some("c"), ""),
            HashSeed::new("a", Some("bc"), "")
        );
        assert_eq!(a, HashSeed::new("m", Some(""), ""));
    }

    proptest! {
        /// The chain is the format the workers' reports carry: block `i` is xxh3-64 of its
        /// ids' little-endian bytes, seeded by block `i - 1`'s hash (the seed for block 0).
        #[test]
        fn block_hashes_are_xxh3_of_little_endian_ids_chained(
            tokens in prop::collection::vec(any::<u32>(), 0..300),
            block in 1usize..40,
        ) {
            let mut prev = SEED.0;
            let expected: Vec<u64> = tokens
                .chunks_exact(block)
                .map(|ids| {
                    let bytes: Vec<u8> = ids.iter().flat_map(|t| t.to_le_bytes()).collect();
                    prev = xxh3_64_with_seed(&bytes, prev);
                    prev
                })
                .collect();
            prop_assert_eq!(block_hashes(SEED, &tokens, block), expected);
        }

        #[test]
        fn equal_prefixes_give_equal_chains(
            prefix in prop::collection::vec(any::<u32>(), 0..200),
            a in prop::collection::vec(any::<u32>(), 0..100),
            b in prop::collection::vec(any::<u32>(), 0..100),
            block in 1usize..20,
        ) {
            let ha = block_hashes(SEED, &[prefix.clone(), a].concat(), block);
            let hb = block_hashes(SEED, &[prefix.clone(), b].concat(), block);
            let shared = prefix.len() / block;
            prop_assert_eq!(&ha[..shared], &hb[..shared]);
        }

        #[test]
        fn a_change_in_a_block_changes_every_later_hash(
            tokens in prop::collection::vec(any::<u32>(), 16..400),
            at in any::<prop::sample::Index>(),
            delta in 1u32..,
            block in 1usize..16,
        ) {
            let mut changed = tokens.clone();
            let i = at.index(tokens.len());
            changed[i] = changed[i].wrapping_add(delta);
            let before = block_hashes(SEED, &tokens, block);
            let after = block_hashes(SEED, &changed, block);
            let first_changed = i / block;
            for (k, (x, y)) in before.iter().zip(&after).enumerate() {
                if k < first_changed {
                    prop_assert_eq!(x, y);
                } else {
                    prop_assert_ne!(x, y);
                }
            }
        }

        #[test]
        fn text_chunks_follow_the_same_rules(
            prefix in prop::collection::vec(any::<u8>(), 0..600),
            tail in prop::collection::vec(any::<u8>(), 0..300),
            at in any::<prop::sample::Index>(),
        ) {
            let text = [prefix.clone(), tail].concat();
            let base = text_chunk_hashes(SEED, &text, 64);
            prop_assert_eq!(&base[..prefix.len() / 64], &text_chunk_hashes(SEED, &prefix, 64)[..]);
            if !text.is_empty() {
                let mut changed = text.clone();
                let i = at.index(text.len());
                changed[i] ^= 0x5a;
                let after = text_chunk_hashes(SEED, &changed, 64);
                for k in (i / 64)..base.len() {
                    prop_assert_ne!(base[k], after[k]);
                }
            }
        }
    }
}
