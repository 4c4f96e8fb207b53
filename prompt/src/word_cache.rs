//! Token ids of byte-level words seen before. The `tokenizers` crate's BPE caches each word's
//! merges too, but hands a cached word back as `Token` values with a string and offsets each,
//! which cost more than finding the word; only the ids are kept here. The cache is only ever
//! tried, never waited for: a thread that finds it busy tokenizes the word itself.

use kvgate_protocol::HashKeyMap;
use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::sync::{Mutex, MutexGuard, TryLockError};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Longer words are rare and cost little per byte next to a lookup: not cached.
const MAX_WORD_BYTES: usize = 64;

/// Words a generation holds; two generations approximate LRU, as the segment cache's do.
const GENERATION_WORDS: usize = 1 << 15;

/// The word's hash → the word and its ids (the word is compared, so a collision is a miss).
type Words = HashKeyMap<(Box<str>, Box<[u32]>)>;

pub(crate) struct WordCache {
    cache: Mutex<Generations>,
    /// Seeded per process, so that no one can choose words that all land in one bucket.
    seed: u64,
}

#[derive(Default)]
struct Generations {
    young: Words,
    old: Words,
}

impl WordCache {
    pub fn new() -> Self {
        WordCache {
            cache: Mutex::default(),
            seed: RandomState::new().hash_one(0u8),
        }
    }

    /// Appends `word`'s ids to `ids`: the cached ones, else what `tokenize` appends (then
    /// cached).
    pub fn extend<E>(
        &self,
        word: &str,
        ids: &mut Vec<u32>,
        tokenize: impl FnOnce(&mut Vec<u32>) -> Result<(), E>,
    ) -> Result<(), E> {
        if word.len() > MAX_WORD_BYTES {
            return tokenize(ids);
        }
        let key = xxh3_64_with_seed(word.as_bytes(), self.seed);
        if let Some(mut g) = self.try_lock() {
            if let Some(hit) = g.get(key, word) {
                ids.extend_from_slice(hit);
                return Ok(());
            }
        }
        let start = ids.len();
        tokenize(ids)?;
        if let Some(mut g) = self.try_lock() {
            g.insert(key, word, &ids[start..]);
        }
        Ok(())
    }

    fn try_lock(&self) -> Option<MutexGuard<'_, Generations>> {
        match self.cache.try_lock() {
            Ok(g) => Some(g),
            Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.try_lock().map_or(0, |g| g.young.len() + g.old.len())
    }
}

impl Generations {
    fn get(&mut self, key: u64, word: &str) -> Option<&[u32]> {
        if !self.young.contains_key(&key) {
            let entry = self.old.remove(&key)?;
            self.young.insert(key, entry);
        }
        self.young
            .get(&key)
            .filter(|(w, _)| &**w == word)
            .map(|(_, ids)| &**ids)
    }

    fn insert(&mut self, key: u64, word: &str, ids: &[u32]) {
        if self.young.len() >= GENERATION_WORDS {
            self.old = std::mem::take(&mut self.young);
        }
        self.young.insert(key, (word.into(), ids.into()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn extend(cache: &WordCache, word: &str, ids: &[u32], tokenized: &mut usize) -> Vec<u32> {
        let mut out = vec![7];
        cache
            .extend(word, &mut out, |out| -> Result<(), ()> {
                *tokenized += 1;
                out.extend_from_slice(ids);
                Ok(())
            })
            .ok();
        out
    }

    #[test]
    fn a_word_is_tokenized_once_and_then_found() {
        let cache = WordCache::new();
        let mut tokenized = 0;
        assert_eq!(extend(&cache, "Ġhello", &[1, 2], &mut tokenized), [7, 1, 2]);
        assert_eq!(extend(&cache, "Ġhello", &[9], &mut tokenized), [7, 1, 2]);
        assert_eq!(tokenized, 1);
        let long = "x".repeat(MAX_WORD_BYTES + 1);
        extend(&cache, &long, &[3], &mut tokenized);
        extend(&cache, &long, &[3], &mut tokenized);
        assert_eq!(tokenized, 3, "a long word is not cached");
    }

    #[test]
    fn a_word_whose_hash_another_has_is_a_miss() {
        let mut g = Generations::default();
        g.insert(1, "Ġa", &[4]);
        assert_eq!(g.get(1, "Ġb"), None);
        assert_eq!(g.get(1, "Ġa"), Some(&[4][..]));
    }

    #[test]
    fn a_busy_cache_is_not_waited_for() {
        let cache = WordCache::new();
        let mut tokenized = 0;
        let held = cache.cache.lock();
        assert_eq!(extend(&cache, "Ġa", &[4], &mut tokenized), [7, 4]);
        drop(held);
        assert_eq!(cache.len(), 0, "nothing cached while busy");
        extend(&cache, "Ġa", &[4], &mut tokenized);
        assert_eq!((tokenized, cache.len()), (2, 1));
    }

    #[test]
    fn the_old_generation_goes_when_the_young_fills() {
        let cache = WordCache::new();
        let mut tokenized = 0;
        for i in 0..2 * GENERATION_WORDS + 1 {
            extend(&cache, &i.to_string(), &[1], &mut tokenized);
        }
        assert_eq!(cache.len(), GENERATION_WORDS + 1);
        // The first word is gone; one of the old generation moves back to the young.
        extend(&cache, "0", &[1], &mut tokenized);
        extend(&cache, &GENERATION_WORDS.to_string(), &[1], &mut tokenized);
        assert_eq!(tokenized, 2 * GENERATION_WORDS + 2);
    }
}
