//! Reading a server-sent event stream (the WHATWG rules): lines end with CRLF, LF or CR, a
//! blank line ends an event, `data:` lines join with newlines, comments (`:`) and other fields
//! are skipped, and an event the stream ends in the middle of is dropped. Incremental: bytes
//! arrive in arbitrary pieces, and each byte is looked at once.

/// The parser's state between pieces of a stream.
#[derive(Debug, Default)]
pub struct SseParser {
    /// The current line's bytes so far.
    line: Vec<u8>,
    /// The current event's data lines, joined.
    data: Option<String>,
    /// The last piece ended with CR: an LF starting the next one ends no further line.
    after_cr: bool,
}

impl SseParser {
    /// Takes the next piece of the stream; the data of every event it completes, in order.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        let mut events = Vec::new();
        let mut rest = bytes;
        if self.after_cr {
            self.after_cr = false;
            if let Some(stripped) = rest.strip_prefix(b"\n") {
                rest = stripped;
            }
        }
        while let Some(end) = rest.iter().position(|&b| b == b'\n' || b == b'\r') {
            self.line.extend_from_slice(&rest[..end]);
            let crlf = rest[end] == b'\r' && rest.get(end + 1) == Some(&b'\n');
            if rest[end] == b'\r' && end + 1 == rest.len() {
                self.after_cr = true;
            }
            rest = &rest[end + if crlf { 2 } else { 1 }..];
            let line = std::mem::take(&mut self.line);
            if let Some(data) = self.take_line(&line) {
                events.push(data);
            }
        }
        self.line.extend_from_slice(rest);
        events
    }

    /// One whole line; the event's data when the line is blank and ends one.
    fn take_line(&mut self, line: &[u8]) -> Option<String> {
        if line.is_empty() {
            return self.data.take();
        }
        let (field, value) = match line.iter().position(|&b| b == b':') {
            Some(0) => return None,
            Some(i) => {
                let value = &line[i + 1..];
                (&line[..i], value.strip_prefix(b" ").unwrap_or(value))
            }
            None => (line, &b""[..]),
        };
        if field == b"data" {
            let value = String::from_utf8_lossy(value);
            match &mut self.data {
                Some(data) => {
                    data.push('\n');
                    data.push_str(&value);
                }
                None => self.data = Some(value.into_owned()),
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(pieces: &[&[u8]]) -> Vec<String> {
        let mut p = SseParser::default();
        pieces.iter().flat_map(|b| p.push(b)).collect()
    }

    #[test]
    fn events_split_anywhere_join_their_data() {
        assert_eq!(
            all(&[b"data: {\"a\"", b":1}\n\ndata: [DONE]\n\n"]),
            ["{\"a\":1}", "[DONE]"]
        );
        assert_eq!(all(&[b"data: x\r\n\r\n"]), ["x"]);
        assert_eq!(
            all(&[b"data: x\r", b"\n\r", b"\n"]),
            ["x"],
            "CRLF split over pieces"
        );
        assert_eq!(
            all(&[b"data: x\r\rdata: y\n\n"]),
            ["x", "y"],
            "CR alone ends lines"
        );
        assert_eq!(all(&[b"data: a\ndata:b\n\n"]), ["a\nb"]);
        assert_eq!(all(&[b": comment\nevent: e\nid: 1\ndata: z\n\n"]), ["z"]);
        assert_eq!(
            all(&[b"data\n\n"]),
            [""],
            "a field with no colon has an empty value"
        );
        assert!(
            all(&[b"data: unfinished\n"]).is_empty(),
            "no blank line, no event"
        );
        assert!(all(&[b"\n\n: only a comment\n\n"]).is_empty());
    }
}
