//! A suffix cache shared by every request: the n-grams of recent prompts and outputs, each
//! with the tokens that followed it, so that a fleet's repeated answers (agents, templates,
//! retries) draft too, which prompt lookup alone cannot do across requests. Bounded in
//! entries, least recently used dropped first; a later occurrence of an n-gram replaces the
//! earlier one's continuation.

use super::{Draft, DraftAsk, Drafter, NgramDrafter, NgramSettings};
use lru::LruCache;
use std::num::NonZeroUsize;

/// Tokens kept after each n-gram: the longest draft the cache can give.
pub const MAX_CONTINUATION: usize = 16;

/// The shortest n-gram the cache matches: across requests a short one says little (any two
/// answers share "of the"), and drafts from it were kept 12 % of the time on open chat, which
/// costs more than it gains; a request's own context is searched from the shorter `min`.
pub const MIN_SHARED_NGRAM: usize = 4;

/// Tokens of a prompt the cache learns, its last ones: a long document's n-grams would push
/// everything else out, and its own request drafts from it by prompt lookup anyway.
pub const LEARNED_PROMPT_TAIL: usize = 1024;

/// Each n-gram (the key itself, so that no two ever collide) and the tokens that followed it.
#[derive(Debug, Clone)]
pub struct SuffixCache {
    settings: NgramSettings,
    entries: LruCache<Box<[u32]>, Box<[u32]>>,
}

impl SuffixCache {
    /// A cache of at most `capacity` n-grams (about 100 bytes each), of `settings`' lengths
    /// but at least [`MIN_SHARED_NGRAM`].
    pub fn new(settings: NgramSettings, capacity: NonZeroUsize) -> Self {
        let min = settings.min.max(MIN_SHARED_NGRAM);
        SuffixCache {
            settings: NgramSettings {
                min,
                max: settings.max.max(min),
            },
            entries: LruCache::new(capacity),
        }
    }

    /// Learns a sequence (a prompt, or a prompt and its output): every n-gram of it with what
    /// followed, later occurrences last so that they win.
    pub fn learn(&mut self, tokens: &[u32]) {
        let NgramSettings { min, max } = self.settings;
        for start in 0..tokens.len() {
            for n in min..=max {
                let from = start + n;
                if from >= tokens.len() {
                    break;
                }
                let ngram = &tokens[start..from];
                let continuation = &tokens[from..tokens.len().min(from + MAX_CONTINUATION)];
                self.entries.put(ngram.into(), continuation.into());
            }
        }
    }

    /// N-grams held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The continuation of the longest suffix of `context` the cache holds.
    pub fn propose(&mut self, context: &[u32], k: usize) -> Vec<u32> {
        let NgramSettings { min, max } = self.settings;
        for n in (min..=max.min(context.len())).rev() {
            let suffix = &context[context.len() - n..];
            if let Some(continuation) = self.entries.get(suffix) {
                return continuation[..k.min(continuation.len())].to_vec();
            }
        }
        Vec::new()
    }
}

/// The request's own context first (prompt lookup, the most specific evidence: source 0), then
/// what every request before it said (source 1, whose drafts fare otherwise: worth much on
/// repeated answers, little on open chat).
#[derive(Debug, Clone)]
pub struct SuffixDrafter {
    lookup: NgramDrafter,
    cache: SuffixCache,
}

impl SuffixDrafter {
    pub fn new(settings: NgramSettings, entries: NonZeroUsize) -> Self {
        SuffixDrafter {
            lookup: NgramDrafter::new(settings),
            cache: SuffixCache::new(settings, entries),
        }
    }
}

impl SuffixDrafter {
    fn draft(&mut self, context: &[u32], k: usize) -> Draft {
        let own = self.lookup.propose(context, k);
        if !own.is_empty() {
            return Draft {
                tokens: own,
                source: 0,
            };
        }
        Draft {
            tokens: self.cache.propose(context, k),
            source: 1,
        }
    }
}

impl Drafter for SuffixDrafter {
    fn propose(&mut self, context: &[u32], k: usize) -> Vec<u32> {
        self.draft(context, k).tokens
    }

    fn propose_batch(&mut self, asks: &[DraftAsk<'_>]) -> Vec<Draft> {
        asks.iter().map(|a| self.draft(a.context, a.k)).collect()
    }

    fn learn_prompt(&mut self, prompt: &[u32]) {
        self.cache
            .learn(&prompt[prompt.len().saturating_sub(LEARNED_PROMPT_TAIL)..]);
    }

    fn learn_output(&mut self, tokens: &[u32]) {
        self.cache.learn(tokens);
    }

    fn clone_box(&self) -> Box<dyn Drafter> {
        Box::new(self.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cache matching n-grams of 4 and 5 tokens.
    fn cache(capacity: usize) -> SuffixCache {
        SuffixCache::new(
            NgramSettings::new(2, 5).unwrap(),
            NonZeroUsize::new(capacity).unwrap(),
        )
    }

    #[test]
    fn a_learned_answer_drafts_for_another_request() {
        let mut c = cache(1_000);
        // One request's prompt and answer: "... tool call: [10, 11, 12, 13, 14]".
        c.learn(&[1, 2, 3, 4, 5, 10, 11, 12, 13, 14]);
        // Another request reaches the same point in its own context.
        assert_eq!(c.propose(&[9, 9, 3, 4, 5, 10], 3), vec![11, 12, 13]);
        assert_eq!(
            c.propose(&[3, 4, 5, 10], 8),
            vec![11, 12, 13, 14],
            "to its end"
        );
        assert!(c.propose(&[4, 5, 6, 7], 3).is_empty(), "never seen");
        assert!(
            c.propose(&[9, 5, 10], 3).is_empty(),
            "shorter than a shared n-gram"
        );
        assert!(c.propose(&[2, 3, 4, 5], 0).is_empty());
    }

    #[test]
    fn the_longest_suffix_and_the_latest_occurrence_win() {
        let mut c = cache(1_000);
        c.learn(&[5, 1, 2, 3, 4, 7]);
        c.learn(&[6, 1, 2, 3, 4, 8]);
        // [1..4]: the later sequence's continuation; [5, 1..4]: only the first had it.
        assert_eq!(c.propose(&[0, 1, 2, 3, 4], 1), vec![8]);
        assert_eq!(c.propose(&[5, 1, 2, 3, 4], 1), vec![7]);
    }

    #[test]
    fn the_drafter_prefers_the_requests_own_context_then_asks_the_cache() {
        let settings = NgramSettings::new(2, 3).unwrap();
        let mut d = SuffixDrafter::new(settings, NonZeroUsize::new(10_000).unwrap());
        d.learn_output(&[40, 41, 42, 43, 6, 7, 8]);
        // Its own context repeats [1, 2] followed by 3: that wins over the cache.
        assert_eq!(d.propose(&[1, 2, 3, 9, 4, 5, 1, 2], 2), vec![3, 9]);
        // Nothing of its own: what another request said after [40..43].
        assert_eq!(d.propose(&[0, 40, 41, 42, 43], 2), vec![6, 7]);
        let ask = |context| DraftAsk {
            id: 1,
            context,
            num_prompt_tokens: 1,
            k: 2,
        };
        let sources: Vec<usize> = d
            .propose_batch(&[ask(&[1, 2, 3, 1, 2]), ask(&[0, 40, 41, 42, 43])])
            .iter()
            .map(|draft| draft.source)
            .collect();
        assert_eq!(sources, [0, 1], "its own context, then the shared cache");
        assert!(
            d.propose(&[0, 42, 43], 2).is_empty(),
            "two tokens in common with another request are not enough"
        );
        // A prompt's tail is learned, its head is not.
        let long: Vec<u32> = (100..100 + LEARNED_PROMPT_TAIL as u32 + 10).collect();
        d.learn_prompt(&long);
        assert_eq!(
            d.propose(&[0, long[18], long[19], long[20], long[21]], 1),
            vec![long[22]]
        );
        assert!(d
            .propose(&[0, long[1], long[2], long[3], long[4]], 1)
            .is_empty());
    }

    #[test]
    fn it_holds_at_most_its_capacity_and_forgets_the_least_recently_used() {
        let mut c = cache(4);
        c.learn(&(0..100).collect::<Vec<u32>>());
        assert_eq!(c.len(), 4);
        assert!(
            c.propose(&[0, 1, 2, 3], 1).is_empty(),
            "the first n-grams were dropped"
        );
        assert_eq!(c.propose(&[94, 95, 96, 97], 1), vec![98]);
        let long: Vec<u32> = (0..40).collect();
        let mut c = cache(1_000);
        c.learn(&long);
        assert_eq!(c.propose(&[0, 1, 2, 3], 99).len(), MAX_CONTINUATION);
    }
}
