//! Tokenization cached per segment. The tokenizer cuts text at added (special) tokens before
//! anything else, so the text between two of them tokenizes the same whatever surrounds it:
//! ids can be cached per segment exactly, and a system prompt or an earlier turn seen before
//! is not tokenized again.

use crate::added::Piece;
use crate::tokenizer::{Tokenizer, TokenizerError};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use xxhash_rust::xxh3::xxh3_128;

/// Shorter segments are tokenized every time: caching them would cost more than it saves.
const MIN_CACHED_BYTES: usize = 64;

pub struct SegmentCache {
    capacity_tokens: usize,
    cache: Mutex<Generations>,
}

/// Takes `bytes` from `budget` if it holds that many.
fn spend(budget: &mut usize, bytes: usize) -> bool {
    match budget.checked_sub(bytes) {
        Some(left) => {
            *budget = left;
            true
        }
        None => false,
    }
}

/// Two generations approximate LRU: hits in the old one move to the young one, and when the
/// young one is full the old one is dropped.
#[derive(Default)]
struct Generations {
    young: HashMap<u128, Arc<[u32]>>,
    young_tokens: usize,
    old: HashMap<u128, Arc<[u32]>>,
}

impl SegmentCache {
    /// A cache of at most about `capacity_tokens` token ids.
    pub fn new(capacity_tokens: usize) -> Self {
        SegmentCache {
            capacity_tokens,
            cache: Mutex::new(Generations::default()),
        }
    }

    /// Ids of `text` with added-token text parsed, equal to `tokenizer.encode(text, true)`.
    pub fn encode(&self, tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let mut unbounded = usize::MAX;
        Ok(self
            .encode_within(tokenizer, text, &mut unbounded)?
            .unwrap_or_default())
    }

    /// As [`SegmentCache::encode`] while the text it finds in no cache comes to at most
    /// `budget` bytes (what is tokenized is taken from it); `None` as soon as a segment would
    /// exceed it, before that segment is tokenized.
    pub fn encode_within(
        &self,
        tokenizer: &Tokenizer,
        text: &str,
        budget: &mut usize,
    ) -> Result<Option<Vec<u32>>, TokenizerError> {
        let Some(added) = tokenizer.added_tokens() else {
            if !spend(budget, text.len()) {
                return Ok(None);
            }
            return tokenizer.encode(text, true).map(Some);
        };
        let mut ids = Vec::with_capacity(text.len() / 3);
        for piece in added.split(text) {
            match piece {
                Piece::Text(segment) => {
                    if !self.encode_segment(tokenizer, segment, &mut ids, budget)? {
                        return Ok(None);
                    }
                }
                Piece::Token(id) => ids.push(id),
            }
        }
        Ok(Some(ids))
    }

    /// Appends `segment`'s ids; false, with nothing appended, when it is not cached and
    /// longer than what is left of `budget`.
    fn encode_segment(
        &self,
        tokenizer: &Tokenizer,
        segment: &str,
        ids: &mut Vec<u32>,
        budget: &mut usize,
    ) -> Result<bool, TokenizerError> {
        if segment.len() < MIN_CACHED_BYTES {
            if !spend(budget, segment.len()) {
                return Ok(false);
            }
            ids.extend(tokenizer.encode(segment, true)?);
            return Ok(true);
        }
        let key = xxh3_128(segment.as_bytes());
        if let Some(hit) = self.lookup(key) {
            ids.extend_from_slice(&hit);
            return Ok(true);
        }
        if !spend(budget, segment.len()) {
            return Ok(false);
        }
        let fresh: Arc<[u32]> = tokenizer.encode(segment, true)?.into();
        ids.extend_from_slice(&fresh);
        self.insert(key, fresh);
        Ok(true)
    }

    fn lookup(&self, key: u128) -> Option<Arc<[u32]>> {
        let mut g = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(hit) = g.young.get(&key) {
            return Some(Arc::clone(hit));
        }
        let hit = g.old.remove(&key)?;
        g.young_tokens += hit.len();
        g.young.insert(key, Arc::clone(&hit));
        Some(hit)
    }

    fn insert(&self, key: u128, ids: Arc<[u32]>) {
        let mut g = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        g.young_tokens += ids.len();
        g.young.insert(key, ids);
        if g.young_tokens > self.capacity_tokens / 2 {
            g.old = std::mem::take(&mut g.young);
            g.young_tokens = 0;
        }
    }

    /// Token ids held (both generations).
    #[cfg(test)]
    pub fn cached_tokens(&self) -> usize {
        let g = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        g.young
            .values()
            .chain(g.old.values())
            .map(|v| v.len())
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::Tokenizer;

    /// A word-level tokenizer whose every segment is one token (0), with `<s>` (1) added.
    fn one_token_per_segment(name: &str) -> Result<Tokenizer, String> {
        let json = r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[{"id":1,"content":"<s>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true}],"normalizer":null,"pre_tokenizer":null,"post_processor":null,"decoder":null,"model":{"type":"WordLevel","vocab":{"a":0,"<s>":1},"unk_token":"a"}}"#;
        let dir = std::env::temp_dir().join(format!("kvgate-seg-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).ok();
        let path = dir.join("tokenizer.json");
        std::fs::write(&path, json).ok();
        let (tokenizer, _) = Tokenizer::from_json_file(&path).map_err(|e| e.to_string())?;
        std::fs::remove_dir_all(&dir).ok();
        Ok(tokenizer)
    }

    /// A two-generation cache keeps what is used and drops what is not.
    #[test]
    fn the_old_generation_goes_when_the_young_fills() -> Result<(), String> {
        let tokenizer = one_token_per_segment("generations")?;
        let cache = SegmentCache::new(4);
        let seg = |c: char| c.to_string().repeat(MIN_CACHED_BYTES);
        for c in ['x', 'y', 'z'] {
            assert_eq!(cache.encode(&tokenizer, &seg(c)).ok(), Some(vec![0]));
        }
        // Capacity 4: the young generation turns old after 3 tokens; one hit moves back.
        assert!(cache.cached_tokens() <= 3, "{}", cache.cached_tokens());
        Ok(())
    }

    /// Within a budget only text found in no cache counts, and a text over it is refused
    /// before anything of it is tokenized or cached.
    #[test]
    fn a_budget_counts_only_the_text_no_cache_holds() -> Result<(), String> {
        let tokenizer = one_token_per_segment("budget")?;
        let cache = SegmentCache::new(1 << 20);
        let system = "x".repeat(4 * MIN_CACHED_BYTES);
        let user = "y".repeat(2 * MIN_CACHED_BYTES);
        let text = format!("{system}<s>{user}<s>ok");
        let within = |text: &str, budget: usize| {
            let mut left = budget;
            let ids = cache.encode_within(&tokenizer, text, &mut left);
            (ids.map_err(|e| e.to_string()), left)
        };
        assert_eq!(within(&text, 3 * MIN_CACHED_BYTES).0?, None);
        assert_eq!(
            cache.cached_tokens(),
            0,
            "nothing cached from a refused text"
        );
        cache
            .encode(&tokenizer, &format!("{system}<s>"))
            .map_err(|e| e.to_string())?;
        let (ids, left) = within(&text, 3 * MIN_CACHED_BYTES);
        assert_eq!(ids?, Some(vec![0, 1, 0, 1, 0]));
        assert_eq!(left, MIN_CACHED_BYTES - 2, "the user text and `ok` spent");
        let other = format!("{system}<s>{}<s>ok", "z".repeat(2 * MIN_CACHED_BYTES));
        let over = within(&other, 2 * MIN_CACHED_BYTES + 1).0?;
        assert_eq!(over, None, "`ok` is one byte over");
        let whole = cache.encode(&tokenizer, &text).map_err(|e| e.to_string())?;
        assert_eq!(
            within(&text, 2).0?,
            Some(whole),
            "the same ids once all is cached"
        );
        Ok(())
    }
}
