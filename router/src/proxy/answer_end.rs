//! Whether a replica's answer ended whole. Its bytes are passed on as they come, so a garbled
//! one cannot be held back; but a whole OpenAI answer ends in a known way — a stream with
//! `data: [DONE]`, a JSON answer with its closing `}` — and one that does not counts as the
//! replica's failure, so that a replica answering garbage is ejected like one answering 500s.
//! Only the last bytes are kept: nothing is parsed on the way.

const TAIL: usize = 16;

pub struct AnswerEnd {
    sse: bool,
    tail: [u8; TAIL],
    len: usize,
}

impl AnswerEnd {
    pub fn new(sse: bool) -> Self {
        AnswerEnd {
            sse,
            tail: [0; TAIL],
            len: 0,
        }
    }

    /// Takes the next chunk of the body.
    pub fn push(&mut self, chunk: &[u8]) {
        if chunk.len() >= TAIL {
            self.tail.copy_from_slice(&chunk[chunk.len() - TAIL..]);
            self.len = TAIL;
            return;
        }
        let keep = (TAIL - chunk.len()).min(self.len);
        self.tail.copy_within(self.len - keep..self.len, 0);
        self.tail[keep..keep + chunk.len()].copy_from_slice(chunk);
        self.len = keep + chunk.len();
    }

    /// The body so far ends as a whole answer does.
    pub fn is_whole(&self) -> bool {
        let end = self.tail[..self.len].trim_ascii_end();
        if self.sse {
            end.ends_with(b"data: [DONE]") || end.ends_with(b"data:[DONE]")
        } else {
            end.ends_with(b"}")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn whole(sse: bool, chunks: &[&[u8]]) -> bool {
        let mut end = AnswerEnd::new(sse);
        for c in chunks {
            end.push(c);
        }
        end.is_whole()
    }

    #[test]
    fn a_stream_is_whole_when_it_ends_with_done_however_it_is_split() {
        let body = b"data: {\"choices\":[]}\n\ndata: [DONE]\n\n";
        for cut in 0..body.len() {
            let (a, b) = body.split_at(cut);
            assert!(whole(true, &[a, b]), "cut at {cut}");
        }
        let bytes: Vec<&[u8]> = body.chunks(1).collect();
        assert!(whole(true, &bytes));
        assert!(whole(true, &[b"data:[DONE]\r\n\r\n"]));
    }

    #[test]
    fn a_stream_cut_short_or_garbled_is_not_whole() {
        assert!(!whole(true, &[b"data: {\"choices\":[]}\n\n"]));
        assert!(!whole(
            true,
            &[b"data: noise\n\ndata: {\"choices\": [\n\nnoise"]
        ));
        assert!(!whole(true, &[]));
        assert!(!whole(true, &[b"[DONE]"]));
    }

    #[test]
    fn a_json_answer_is_whole_when_it_closes() {
        assert!(whole(false, &[b"{\"choices\":", b"[]}\n"]));
        assert!(!whole(false, &[b"{\"choices\":["]));
        assert!(!whole(false, &[b"not json"]));
        assert!(!whole(false, &[]));
    }
}
