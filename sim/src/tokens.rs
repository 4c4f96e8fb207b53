//! Prompts as token ids. `kvgate bench`'s prompts are common words, one token each in the
//! vocabularies of byte-level BPE models; the simulator gives each word a stable id, so two
//! prompts share token ids exactly where they share words.

use xxhash_rust::xxh3::xxh3_64;

/// Ids below this are left to special tokens.
const FIRST_ID: u64 = 1_000;
const IDS: u64 = 40_000;

pub fn ids(text: &str) -> Vec<u32> {
    text.split_whitespace()
        .map(|w| (FIRST_ID + xxh3_64(w.as_bytes()) % IDS) as u32)
        .collect()
}

/// Ids that stand for `output` after detokenizing and tokenizing again when that does not
/// round-trip: as many, none of them (in all likelihood) the same.
pub fn retokenized(output: &[u32]) -> Vec<u32> {
    output
        .iter()
        .enumerate()
        .map(|(i, &t)| {
            let bytes = [t.to_le_bytes(), (i as u32).to_le_bytes()].concat();
            (FIRST_ID + xxh3_64(&bytes) % IDS) as u32
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_same_words_are_the_same_ids() {
        let a = super::ids(" the system prompt and a question");
        let b = super::ids(" the system prompt and another");
        assert_eq!(a[..4], b[..4]);
        assert_ne!(a[4], b[4]);
        assert!(a.iter().all(|&t| t >= 1_000));
    }

    #[test]
    fn retokenized_answers_keep_their_length_not_their_ids() {
        let answer: Vec<u32> = (2_000..2_064).collect();
        let again = super::retokenized(&answer);
        assert_eq!(again.len(), answer.len());
        assert!(again.iter().zip(&answer).filter(|(a, b)| a == b).count() < 4);
        assert_eq!(again, super::retokenized(&answer));
    }
}
