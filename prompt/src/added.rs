//! Added (special) tokens cut text before anything else is done to it, as in the `tokenizers`
//! crate: the leftmost match, the longest one starting there, each text matched verbatim.

use aho_corasick::{AhoCorasick, MatchKind};

/// The added tokens' texts, found by one automaton (it skips text that cannot start one).
pub(crate) struct AddedTokens {
    finder: AhoCorasick,
    ids: Vec<u32>,
}

/// A piece of text between added tokens, or one of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Piece<'t> {
    Text(&'t str),
    Token(u32),
}

impl AddedTokens {
    pub fn new(mut tokens: Vec<(String, u32)>) -> Result<Self, aho_corasick::BuildError> {
        tokens.retain(|(text, _)| !text.is_empty());
        let finder = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(tokens.iter().map(|(text, _)| text))?;
        let ids = tokens.into_iter().map(|(_, id)| id).collect();
        Ok(AddedTokens { finder, ids })
    }

    /// `text` cut at the added tokens in it, in order; empty pieces of text are left out.
    pub fn split<'a, 't: 'a>(&'a self, text: &'t str) -> impl Iterator<Item = Piece<'t>> + 'a {
        let mut start = 0;
        let mut matches = self.finder.find_iter(text);
        let mut token = None;
        std::iter::from_fn(move || {
            if let Some(id) = token.take() {
                return Some(Piece::Token(id));
            }
            let Some(m) = matches.next() else {
                let rest = &text[start..];
                start = text.len();
                return (!rest.is_empty()).then_some(Piece::Text(rest));
            };
            let (before, id) = (&text[start..m.start()], self.ids[m.pattern().as_usize()]);
            start = m.end();
            if before.is_empty() {
                return Some(Piece::Token(id));
            }
            token = Some(id);
            Some(Piece::Text(before))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_token_at_the_leftmost_match_wins() {
        let added = AddedTokens::new(vec![
            ("<s>".into(), 1),
            ("<s><s>".into(), 2),
            ("s>".into(), 3),
            (String::new(), 4),
        ])
        .unwrap_or_else(|e| panic!("{e}"));
        let pieces: Vec<_> = added.split("a<s><s><s>b s>é").collect();
        use Piece::*;
        assert_eq!(
            pieces,
            [
                Text("a"),
                Token(2),
                Token(1),
                Text("b "),
                Token(3),
                Text("é")
            ]
        );
        assert_eq!(added.split("").count(), 0);
        assert_eq!(added.split("<s>").collect::<Vec<_>>(), [Token(1)]);
    }
}
