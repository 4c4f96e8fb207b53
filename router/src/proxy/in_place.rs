//! Which request bodies the proxy thread parses itself. Pingora runs one runtime per thread,
//! so work in place holds up every other connection on the thread; a hand-off to a blocking
//! thread costs two thread wake-ups. A body's parse takes time by its size (about 0.15 µs per
//! KiB of text) and by its structure: a value after a comma up to 130 ns (a chat message), a
//! string escape 7 ns (`cargo bench -p kvgate-protocol --bench parse`). So a body is parsed
//! in place when it is small, or when it is not too large and its commas and escapes, weighed
//! by what each costs, bound its parse to about 0.1 ms.

/// Bodies larger than this go to a blocking thread.
const MAX_BYTES: usize = 128 << 10;

/// Bodies up to this size are parsed in place whatever their structure (at most about 60 µs:
/// 400 chat messages).
const ANY_STRUCTURE_BYTES: usize = 16 << 10;

/// A comma counts as this many escapes (a string escape costs the parser about 7 ns)...
const COMMA_WEIGHT: usize = 8;

/// ... and a larger body is parsed in place while its commas and escapes come to at most this
/// many escapes (about 0.1 ms).
const MAX_WEIGHED_ESCAPES: usize = 16 << 10;

/// Whether the proxy thread parses `body` itself.
pub fn parse_here(body: &[u8]) -> bool {
    if body.len() <= ANY_STRUCTURE_BYTES {
        return true;
    }
    if body.len() > MAX_BYTES {
        return false;
    }
    let mut weighed = 0;
    for at in memchr::memchr2_iter(b',', b'\\', body) {
        weighed += if body[at] == b',' { COMMA_WEIGHT } else { 1 };
        if weighed > MAX_WEIGHED_ESCAPES {
            return false;
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(turns: usize, content: &str) -> Vec<u8> {
        let messages: Vec<_> = (0..turns)
            .map(|i| serde_json::json!({"role": "user", "content": format!("{content}{i}")}))
            .collect();
        serde_json::to_vec(&serde_json::json!({"model": "m", "messages": messages}))
            .unwrap_or_default()
    }

    #[test]
    fn small_bodies_are_parsed_here_whatever_their_structure() {
        let body = chat(300, "a");
        assert!(body.len() <= ANY_STRUCTURE_BYTES);
        assert!(parse_here(&body));
    }

    #[test]
    fn long_text_is_parsed_here_and_many_values_are_not() {
        let prose = "words, then more words and a comma now and then in a long prompt. ";
        let long_text = chat(1, &prose.repeat(900));
        assert!(long_text.len() > 48 << 10 && long_text.len() <= MAX_BYTES);
        assert!(parse_here(&long_text), "about 900 commas in text");
        let many_turns = chat(3000, "a");
        assert!(many_turns.len() <= MAX_BYTES);
        assert!(
            !parse_here(&many_turns),
            "3,000 messages: 0.4 ms of parsing"
        );
        let ids: Vec<u32> = (0..20_000).collect();
        let token_prompt = serde_json::to_vec(&serde_json::json!({"model": "m", "prompt": ids}))
            .unwrap_or_default();
        assert!(!parse_here(&token_prompt), "20,000 token ids: 0.17 ms");
    }

    #[test]
    fn escapes_count_and_size_bounds_all() {
        let code = chat(1, &"line\n".repeat(10_000));
        assert!(code.len() > ANY_STRUCTURE_BYTES);
        assert!(parse_here(&code), "10,000 escapes: 70 µs");
        let escapes = chat(1, &"\n".repeat(20_000));
        assert!(!parse_here(&escapes), "20,000 escapes: 0.14 ms");
        assert!(!parse_here(&chat(1, &"a".repeat(MAX_BYTES))));
    }
}
