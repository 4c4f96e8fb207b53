//! GPT-2's word pattern on ASCII text without the regex engine: a request's new text is
//! usually a short ASCII turn, where the engine's per-search set-up costs more than the scan.
//! Equal to the regex on every ASCII text (tested against it).

#[derive(Clone, Copy, PartialEq, Eq)]
enum Class {
    Letter,
    Digit,
    Space,
    Other,
}

fn class(b: u8) -> Class {
    match b {
        b'a'..=b'z' | b'A'..=b'Z' => Class::Letter,
        b'0'..=b'9' => Class::Digit,
        // Unicode's White_Space in ASCII (what `\s` means to the regex).
        b'\t' | b'\n' | 0x0B | 0x0C | b'\r' | b' ' => Class::Space,
        _ => Class::Other,
    }
}

/// The end of the pattern's match at `at` in ASCII `text` (every position starts one), as the
/// regex finds it: a contraction (`'s`, `'t`, `'re`, `'ve`, `'m`, `'ll`, `'d`), else an
/// optional space and a run of letters, of digits or of other non-space characters, else a
/// run of whitespace.
pub(super) fn word_end(text: &[u8], at: usize) -> usize {
    if text[at] == b'\'' {
        let rest = &text[at + 1..];
        for suffix in ["s", "t", "re", "ve", "m", "ll", "d"] {
            if rest.starts_with(suffix.as_bytes()) {
                return at + 1 + suffix.len();
            }
        }
    }
    let (start, run) = match (text[at], text.get(at + 1).map(|&b| class(b))) {
        (b' ', Some(next)) if next != Class::Space => (at + 1, next),
        (b, _) => (at, class(b)),
    };
    start
        + text[start..]
            .iter()
            .take_while(|&&b| class(b) == run)
            .count()
}
