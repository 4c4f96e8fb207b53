//! Reading a request's header: within a deadline for the whole header, so that a client
//! sending a byte now and then cannot hold a connection, and answering what cannot be read
//! (too many or too large headers, malformed, too slow) before the connection closes.

use super::respond;
use crate::config::Limits;
use crate::connections::{unless_shed, Waited};
use kvgate_protocol::{ApiError, ErrorKind};
use pingora_core::protocols::http::ServerSession;
use pingora_core::protocols::Stream;
use pingora_core::ErrorType;
use pingora_timeout::fast_timeout::fast_timeout;
use std::time::Duration;
use tokio::io::AsyncWriteExt;

/// How long a kept-alive connection may idle between requests, in seconds.
pub const KEEPALIVE_S: u64 = 60;

/// The answers to a connection that sent no request in time, and to one past the bound.
const TIMED_OUT: &[u8] =
    b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
const REFUSED: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nRetry-After: 1\r\nConnection: close\r\n\r\n";

/// Marks a connection handed back for its next request.
pub struct Reused;

/// Reads the next request's header; false when there is none to handle (the client closed,
/// it was answered with an error, or `pressed` said to shed it: the connection must close).
pub async fn read_header(
    session: &mut ServerSession,
    limits: &Limits,
    pressed: impl Fn() -> bool,
) -> bool {
    // HTTP/1.1 pipelining: requests sent before their predecessors' answers are answered in
    // order (otherwise all but the first would be dropped with the connection).
    session.set_pipelining_enabled(true);
    // A kept-alive connection first idles (Pingora ends that wait itself).
    let reused = session
        .take_connection_user_context()
        .is_some_and(|c| c.is::<Reused>());
    let idle = if reused { KEEPALIVE_S } else { 0 };
    let deadline = Duration::from_millis(limits.header_timeout_ms) + Duration::from_secs(idle);
    // Pingora's coarse timer (10 ms), armed only if the header is not there yet: a tokio timer
    // armed while the runtime runs writes to its driver's eventfd, once for every request.
    let error = match unless_shed(session.read_request(), deadline, pressed).await {
        Waited::Done(Ok(read)) => return read,
        // Idle (or slow) while too many connections are open: closed without a word, as an
        // idle kept-alive connection may be.
        Waited::Shed => return false,
        Waited::TimedOut => ApiError::new(
            ErrorKind::RequestTimeout,
            format!("the request header did not arrive within {deadline:?}"),
        ),
        Waited::Done(Err(e)) if *e.etype() == ErrorType::InvalidHTTPHeader => {
            let text = e.to_string();
            if text.contains("too many headers") || text.contains("larger than") {
                ApiError::new(
                    ErrorKind::HeadersTooLarge,
                    "too many request headers, or too large (at most 256 headers, 1 MiB in all)",
                )
            } else {
                ApiError::new(ErrorKind::InvalidRequest, "malformed request header")
            }
        }
        Waited::Done(Err(e)) => {
            tracing::debug!(error = %e, "cannot read request header");
            return false;
        }
    };
    session.set_keepalive(None);
    respond::send_error(session, &error, "none").await;
    false
}

/// The first bytes of a connection within `deadline`, unless `pressed` says to shed it first.
/// Pingora reads a connection's first 24 bytes (to tell an h2c preface from HTTP/1) with no
/// deadline, so a client that sends fewer, or nothing, would hold the connection for ever;
/// this reads them first, with one.
pub async fn first_bytes(
    stream: &mut Stream,
    deadline: Duration,
    pressed: impl Fn() -> bool,
) -> bool {
    let mut preface = [0u8; 24];
    // Peeked bytes are put back for Pingora's own look.
    if let Waited::Done(read) = unless_shed(stream.try_peek(&mut preface), deadline, pressed).await
    {
        return read.is_ok();
    }
    // What was read is gone with the connection, which closes now.
    send_and_close(stream, TIMED_OUT).await;
    false
}

/// Answers a connection past `limits.max_connections` with 503 before it closes (a client that
/// has sent its request reads it as the answer; a short wait, since nothing is read).
pub async fn refuse(mut stream: Stream) {
    send_and_close(&mut stream, REFUSED).await;
}

/// Writes a last answer, flushed past the connection's write buffer, within a short wait
/// (nothing is read, so a client that does not read cannot hold the connection).
async fn send_and_close(stream: &mut Stream, answer: &[u8]) {
    let send = async {
        stream.write_all(answer).await?;
        stream.flush().await
    };
    let _ = fast_timeout(Duration::from_millis(100), send).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::write_buffered::WriteBuffered;
    use pingora_core::protocols::l4::stream::Stream as L4Stream;
    use std::io::Read;

    /// A served connection whose writes wait in a buffer, as every client connection's do,
    /// and the client's end.
    async fn buffered_connection() -> (Stream, std::net::TcpStream) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (served, _) = listener.accept().await.unwrap();
        (Box::new(WriteBuffered::new(L4Stream::from(served))), client)
    }

    fn answer(mut client: std::net::TcpStream) -> String {
        let mut out = String::new();
        let _ = client.read_to_string(&mut out);
        out
    }

    #[tokio::test]
    async fn a_silent_connection_reads_its_408_before_it_closes() {
        let (mut stream, client) = buffered_connection().await;
        let read = first_bytes(&mut stream, Duration::from_millis(50), || false).await;
        assert!(!read);
        drop(stream);
        assert!(answer(client).starts_with("HTTP/1.1 408"));
    }

    #[tokio::test]
    async fn a_connection_past_the_bound_reads_its_503_before_it_closes() {
        let (stream, client) = buffered_connection().await;
        refuse(stream).await;
        assert!(answer(client).starts_with("HTTP/1.1 503"));
    }
}
