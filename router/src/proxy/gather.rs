//! Writing a burst of upstream chunks to the client at once.

use super::answer_end::AnswerEnd;
use crate::idle_pool::now_or_never;
use bytes::{Bytes, BytesMut};
use pingora_core::protocols::http::client::HttpSession;

/// Most bytes of a burst of chunks written to the client at once.
const GATHER_BYTES: usize = 64 << 10;

/// `chunk` and the chunks the replica sent after it that are already here (none is waited
/// for), up to [`GATHER_BYTES`]: a burst is one write to the client, not one per chunk. Also
/// the read that ended the gathering other than by waiting (the answer's end, a failure, a
/// chunk over the limit), which the caller handles next.
pub fn gather(
    upstream: &mut HttpSession,
    chunk: Bytes,
    end: &mut AnswerEnd,
) -> (Bytes, Option<pingora_core::Result<Option<Bytes>>>) {
    let mut gathered = BytesMut::new();
    let stop = loop {
        match now_or_never(upstream.read_response_body()) {
            None => break None,
            Some(Ok(Some(more))) if chunk.len() + gathered.len() + more.len() <= GATHER_BYTES => {
                end.push(&more);
                if gathered.is_empty() {
                    gathered.extend_from_slice(&chunk);
                }
                gathered.extend_from_slice(&more);
            }
            Some(read) => break Some(read),
        }
    };
    let chunk = if gathered.is_empty() {
        chunk
    } else {
        gathered.freeze()
    };
    (chunk, stop)
}
