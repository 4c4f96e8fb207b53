//! Streaming detokenisation with stop strings. Text is released only once it is complete
//! UTF-8 (a token may end inside a character) and cannot be the start of a stop string; a
//! matched stop string ends the output before it.

use crate::model::tokenizer::Tokenizer;

pub struct TextStream {
    ids: Vec<u32>,
    /// Tokens before `prefix` are fully emitted; `prefix..read` decode to text already seen.
    prefix: usize,
    read: usize,
    /// Decoded but not yet released (could begin a stop string).
    held: String,
    stops: Vec<String>,
    stopped: bool,
}

impl TextStream {
    pub fn new(stops: Vec<String>) -> Self {
        TextStream {
            ids: Vec::new(),
            prefix: 0,
            read: 0,
            held: String::new(),
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            stopped: false,
        }
    }

    /// Whether a stop string has matched (the request should end).
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Adds a token; returns the text that can be released now.
    pub fn push(&mut self, token: u32, tokenizer: &Tokenizer) -> String {
        if self.stopped {
            return String::new();
        }
        self.ids.push(token);
        let seen = tokenizer
            .decode(&self.ids[self.prefix..self.read], true)
            .unwrap_or_default();
        let now = tokenizer
            .decode(&self.ids[self.prefix..], true)
            .unwrap_or_default();
        if now.len() <= seen.len() || now.ends_with('\u{FFFD}') || !now.is_char_boundary(seen.len())
        {
            // An incomplete character: wait for the next token.
            return String::new();
        }
        self.held.push_str(&now[seen.len()..]);
        self.prefix = self.read;
        self.read = self.ids.len();
        self.release()
    }

    /// Releases what is held (the request ended).
    pub fn finish(&mut self) -> String {
        if self.stopped {
            return String::new();
        }
        std::mem::take(&mut self.held)
    }

    fn release(&mut self) -> String {
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min()
        {
            self.stopped = true;
            let out = self.held[..at].to_string();
            self.held.clear();
            return out;
        }
        // Keep the longest tail that is a proper prefix of some stop string.
        let keep = self
            .stops
            .iter()
            .flat_map(|s| {
                (1..s.len())
                    .filter(|&n| s.is_char_boundary(n))
                    .map(move |n| &s[..n])
            })
            .filter(|p| self.held.ends_with(p))
            .map(str::len)
            .max()
            .unwrap_or(0);
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        out
    }
}
