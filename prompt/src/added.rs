//! Added (special) tokens cut text before anything else is done to it, as in the `tokenizers`
//! crate: the leftmost match, the longest one starting there, each text matched verbatim.

/// Added tokens' texts with their ids, longest first (so the longest match wins).
pub(crate) struct AddedTokens {
    tokens: Vec<(String, u32)>,
    /// First bytes of the texts, to skip the rest of the text quickly.
    starts: [bool; 256],
}

/// A piece of text between added tokens, or one of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Piece<'t> {
    Text(&'t str),
    Token(u32),
}

impl AddedTokens {
    pub fn new(mut tokens: Vec<(String, u32)>) -> Self {
        tokens.retain(|(text, _)| !text.is_empty());
        tokens.sort_by(|x, y| y.0.len().cmp(&x.0.len()).then(x.0.cmp(&y.0)));
        let mut starts = [false; 256];
        for (text, _) in &tokens {
            starts[text.as_bytes()[0] as usize] = true;
        }
        AddedTokens { tokens, starts }
    }

    /// `text` cut at the added tokens in it, in order; empty pieces of text are left out.
    pub fn split<'a, 't>(&'a self, text: &'t str) -> Split<'a, 't> {
        Split {
            added: self,
            text,
            start: 0,
            at: 0,
            token: None,
        }
    }

    fn token_at(&self, bytes: &[u8]) -> Option<&(String, u32)> {
        if !self.starts[bytes[0] as usize] {
            return None;
        }
        self.tokens
            .iter()
            .find(|(t, _)| bytes.starts_with(t.as_bytes()))
    }
}

pub(crate) struct Split<'a, 't> {
    added: &'a AddedTokens,
    text: &'t str,
    /// Where the current piece of text starts.
    start: usize,
    /// Where the search for the next added token goes on.
    at: usize,
    /// An added token found after the piece of text just returned.
    token: Option<u32>,
}

impl<'t> Iterator for Split<'_, 't> {
    type Item = Piece<'t>;

    fn next(&mut self) -> Option<Piece<'t>> {
        if let Some(id) = self.token.take() {
            return Some(Piece::Token(id));
        }
        let bytes = self.text.as_bytes();
        while self.at < bytes.len() {
            let Some((t, id)) = self.added.token_at(&bytes[self.at..]) else {
                self.at += 1;
                continue;
            };
            // An added token starts with a whole character, so `at` is a boundary.
            let before = &self.text[self.start..self.at];
            self.at += t.len();
            self.start = self.at;
            if before.is_empty() {
                return Some(Piece::Token(*id));
            }
            self.token = Some(*id);
            return Some(Piece::Text(before));
        }
        let rest = &self.text[self.start..];
        self.start = self.text.len();
        (!rest.is_empty()).then_some(Piece::Text(rest))
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
        ]);
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
