//! Byte-level BPE's pre-tokenizer done directly on the text: numeric characters one by one
//! (where the model asks for it), then GPT-2's word pattern (scanned by hand on ASCII text,
//! `byte_level/ascii.rs`; by the `regex` crate otherwise), then each byte as its printable
//! symbol. The `tokenizers` crate does the same through per-byte alignment tables and a
//! backtracking regex engine, which costs several times more on a request's short user turn;
//! the ids are checked equal to the crate's (the tokenizer's tests, the fuzz target).

use regex::Regex;

mod ascii;

/// GPT-2's pattern without its look-ahead alternative `\s+(?!\S)`, which [`ByteLevelWords`]
/// applies by hand.
const WORDS: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+";

pub(crate) struct ByteLevelWords {
    individual_digits: bool,
    words: Regex,
    symbols: [char; 256],
}

impl ByteLevelWords {
    pub fn new(individual_digits: bool) -> Result<Self, regex::Error> {
        Ok(ByteLevelWords {
            individual_digits,
            words: Regex::new(WORDS)?,
            symbols: symbols(),
        })
    }

    /// Calls `each` with every word of `text`, spelled in byte-level symbols, in order.
    pub fn for_each<E>(
        &self,
        text: &str,
        mut each: impl FnMut(&str) -> Result<(), E>,
    ) -> Result<(), E> {
        let mut word = String::new();
        let mut words_of = |piece: &str| {
            let ascii = piece.is_ascii();
            let mut at = 0;
            while at < piece.len() {
                let (start, end) = self.next_word(piece, at, ascii);
                word.clear();
                word.extend(
                    piece.as_bytes()[start..end]
                        .iter()
                        .map(|&b| self.symbols[b as usize]),
                );
                each(&word)?;
                at = end;
            }
            Ok(())
        };
        if !self.individual_digits {
            return words_of(text);
        }
        let mut start = 0;
        for (i, c) in text.char_indices() {
            if c.is_numeric() {
                if start < i {
                    words_of(&text[start..i])?;
                }
                start = i + c.len_utf8();
                words_of(&text[i..start])?;
            }
        }
        if start < text.len() {
            words_of(&text[start..])?;
        }
        Ok(())
    }

    /// The next word of `piece` from `at` (before its end): where it starts and ends.
    /// `ascii`: the piece is all ASCII (false: the regex, whatever the text).
    fn next_word(&self, piece: &str, at: usize, ascii: bool) -> (usize, usize) {
        let (start, end) = if ascii {
            (at, ascii::word_end(piece.as_bytes(), at))
        } else {
            // Every character starts a match of the pattern, so there is one at `at`.
            self.words
                .find_at(piece, at)
                .map_or((at, piece.len()), |m| (m.start(), m.end()))
        };
        (start, look_ahead(piece, start, end))
    }
}

/// The end of the match `start..end` under GPT-2's `\s+(?!\S)`: a run of whitespace
/// followed by a word gives its last character to that word (`"  a"` is `" "`, `" a"`).
/// Only the `\s+` alternative ends in whitespace; being greedy, it stops at a non-space.
fn look_ahead(piece: &str, start: usize, end: usize) -> usize {
    match piece[start..end].char_indices().next_back() {
        Some((last, c)) if c.is_whitespace() && last > 0 && end < piece.len() => start + last,
        _ => end,
    }
}

/// Bytes that stand for themselves in GPT-2's byte-to-symbol table; the others were moved, in
/// order, to U+0100 and up.
fn printable(b: u8) -> bool {
    matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF)
}

fn symbols() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut moved = 0u32;
    for b in 0..=255u8 {
        table[b as usize] = if printable(b) {
            b as char
        } else {
            moved += 1;
            // U+0100..U+0143: always a valid character.
            char::from_u32(0xFF + moved).unwrap_or_default()
        };
    }
    table
}

/// The byte a byte-level symbol stands for (`None` for other characters).
pub(crate) fn byte_of_symbol(c: char) -> Option<u8> {
    let code = c as u32;
    if code < 0x100 {
        return printable(code as u8).then_some(code as u8);
    }
    let moved = code - 0x100;
    (0..=255u8).filter(|&b| !printable(b)).nth(moved as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(text: &str, digits: bool) -> Vec<String> {
        let split = ByteLevelWords::new(digits).unwrap_or_else(|e| panic!("{e}"));
        let mut out = Vec::new();
        split
            .for_each::<()>(text, |w| {
                let bytes: Vec<u8> = w.chars().filter_map(byte_of_symbol).collect();
                out.push(String::from_utf8_lossy(&bytes).into_owned());
                Ok(())
            })
            .ok();
        out
    }

    #[test]
    fn a_whitespace_run_leaves_its_last_space_to_the_next_word() {
        assert_eq!(words("a  b", false), ["a", " ", " b"]);
        assert_eq!(words("a \n\tb", false), ["a", " \n", "\t", "b"]);
        assert_eq!(words("a  ", false), ["a", "  "]);
        assert_eq!(words("a \u{a0}b", false), ["a", " ", "\u{a0}", "b"]);
        assert_eq!(words("I'll go", false), ["I", "'ll", " go"]);
    }

    #[test]
    fn digits_go_one_by_one_and_end_the_pieces_around_them() {
        assert_eq!(words("ab 123x", true), ["ab", " ", "1", "2", "3", "x"]);
        assert_eq!(words("ab 123x", false), ["ab", " 123", "x"]);
        assert_eq!(words("a  1", true), ["a", "  ", "1"]);
    }

    /// Where each word of a text starts and ends.
    type Words = Vec<(usize, usize)>;

    /// Every word of an ASCII text as the scanner and as the regex split it.
    fn both_ways(text: &str) -> (Words, Words) {
        let split = ByteLevelWords::new(false).unwrap_or_else(|e| panic!("{e}"));
        let walk = |next: &dyn Fn(usize) -> (usize, usize)| {
            let (mut at, mut out) = (0, Vec::new());
            while at < text.len() {
                let (start, end) = next(at);
                out.push((start, end));
                at = end;
            }
            out
        };
        (
            walk(&|at| split.next_word(text, at, true)),
            walk(&|at| split.next_word(text, at, false)),
        )
    }

    #[test]
    fn the_ascii_scanner_splits_contractions_and_runs_as_the_regex() {
        for text in [
            "I'll say it's 'reported' 've",
            "''s '",
            "a  b\t\n c",
            " \x0b\x0c\r\x1c x",
            "x!'s",
            " 's",
            "  12ab",
            "a,b. 3",
            "'",
            " ",
            "\x00\x7f~ ~",
        ] {
            let (scanner, regex) = both_ways(text);
            assert_eq!(scanner, regex, "{text:?}");
        }
    }

    proptest::proptest! {
        #[test]
        fn the_ascii_scanner_equals_the_regex_on_any_ascii_text(
            text in proptest::collection::vec(
                proptest::prop_oneof![
                    proptest::sample::select(&b" \t\n\x0b\x0c\r'sdtrevml0A!,\x1c\x00\x7f"[..]),
                    0u8..0x80,
                ],
                0..40,
            )
        ) {
            let text = String::from_utf8(text).unwrap_or_else(|e| panic!("{e}"));
            let (scanner, regex) = both_ways(&text);
            proptest::prop_assert_eq!(scanner, regex);
        }
    }

    #[test]
    fn every_byte_has_its_own_symbol() {
        let table = symbols();
        for b in 0..=255u8 {
            assert_eq!(byte_of_symbol(table[b as usize]), Some(b));
        }
        assert_eq!(table[b' ' as usize], 'Ġ');
    }
}
