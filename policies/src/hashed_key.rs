//! Hash maps keyed by values that are already xxh3 hashes: hashing them again is wasted work.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Passes a u64 key through unchanged.
#[derive(Debug, Default, Clone, Copy)]
pub struct PassThroughHasher(u64);

impl Hasher for PassThroughHasher {
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

/// A map from an xxh3 hash to `V`.
pub type HashKeyMap<V> = HashMap<u64, V, BuildHasherDefault<PassThroughHasher>>;
