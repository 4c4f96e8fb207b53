//! Prompt text of a given length in tokens, deterministically from a seed. Every word is a
//! common English word with a leading space, which byte-level BPE vocabularies (GPT-2, Llama 3,
//! SmolLM2) hold as one token, so N words are close to N tokens; the metrics use the server's
//! token counts, never these. Equal seeds give equal text, so equal block ids give prompts
//! that share a prefix exactly (at word, hence token, boundaries).

use crate::rng::Rng;

const WORDS: &[&str] = &[
    "time",
    "year",
    "people",
    "way",
    "day",
    "man",
    "thing",
    "woman",
    "life",
    "child",
    "world",
    "school",
    "state",
    "family",
    "student",
    "group",
    "country",
    "problem",
    "hand",
    "part",
    "place",
    "case",
    "week",
    "company",
    "system",
    "program",
    "question",
    "work",
    "number",
    "night",
    "point",
    "home",
    "water",
    "room",
    "mother",
    "area",
    "money",
    "story",
    "fact",
    "month",
    "lot",
    "right",
    "study",
    "book",
    "eye",
    "job",
    "word",
    "business",
    "issue",
    "side",
    "kind",
    "head",
    "house",
    "service",
    "friend",
    "father",
    "power",
    "hour",
    "game",
    "line",
    "end",
    "member",
    "law",
    "car",
    "city",
    "community",
    "name",
    "team",
    "minute",
    "idea",
    "body",
    "information",
    "back",
    "parent",
    "face",
    "level",
    "office",
    "door",
    "health",
    "person",
    "art",
    "war",
    "history",
    "party",
    "result",
    "change",
    "morning",
    "reason",
    "research",
    "girl",
    "moment",
    "air",
    "teacher",
    "force",
    "education",
    "food",
    "music",
];

/// `tokens` words from `seed`, each with a leading space.
pub fn words(seed: u64, tokens: usize) -> String {
    let mut rng = Rng::new(seed ^ 0x6b76_6761_7465);
    let mut s = String::with_capacity(tokens * 7);
    for _ in 0..tokens {
        s.push(' ');
        s.push_str(WORDS[rng.below(WORDS.len())]);
    }
    s
}

/// Mixes several ids into one seed.
pub fn seed(parts: &[u64]) -> u64 {
    parts.iter().fold(0xcbf2_9ce4_8422_2325, |h, &p| {
        Rng::new(h ^ p.wrapping_mul(0x100_0000_01b3)).next_u64()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_text() {
        assert_eq!(words(5, 100), words(5, 100));
        assert_ne!(words(5, 100), words(6, 100));
        assert_eq!(words(5, 100).split(' ').count(), 101);
        assert!(words(5, 200).starts_with(&words(5, 100)));
        assert_ne!(seed(&[1, 2]), seed(&[2, 1]));
    }
}
