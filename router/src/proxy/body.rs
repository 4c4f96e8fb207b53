//! Reading the whole request body before routing (routing needs the prompt), within a limit.

use bytes::{Bytes, BytesMut};
use kvgate_protocol::{ApiError, ErrorKind};
use pingora_core::protocols::http::ServerSession;
use pingora_timeout::fast_timeout::fast_timeout;

pub enum BodyError {
    /// Over the limit: answer 413 and close the connection (the rest is unread).
    TooLarge(ApiError),
    /// Not all there by the deadline: answer 408 and close the connection.
    TooSlow(ApiError),
    /// The client went away or sent a broken body; nothing can be answered.
    Client(String),
}

/// Reads the whole body, at most `limit` bytes, within `timeout_ms` (a client sending a byte
/// now and then cannot hold the connection).
pub async fn read_body(
    session: &mut ServerSession,
    limit: u64,
    timeout_ms: u64,
) -> Result<Bytes, BodyError> {
    let deadline = std::time::Duration::from_millis(timeout_ms);
    match fast_timeout(deadline, read_within(session, limit)).await {
        Ok(read) => read,
        Err(_) => Err(BodyError::TooSlow(ApiError::new(
            ErrorKind::RequestTimeout,
            format!("the request body did not arrive within {deadline:?} (limits.body_timeout_ms)"),
        ))),
    }
}

async fn read_within(session: &mut ServerSession, limit: u64) -> Result<Bytes, BodyError> {
    let too_large = |got: String| {
        BodyError::TooLarge(ApiError::new(
            ErrorKind::PayloadTooLarge,
            format!("request body of {got} bytes exceeds the limit of {limit} bytes (limits.max_body_bytes)"),
        ))
    };
    let declared = session
        .get_header("content-length")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if let Some(len) = declared.filter(|&len| len > limit) {
        return Err(too_large(len.to_string()));
    }
    let expects_continue = session
        .get_header("expect")
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    if expects_continue {
        // Without this the client waits (curl: one second) before sending the body.
        session.set_close_on_response_before_downstream_finish(false);
        session
            .write_continue_response()
            .await
            .map_err(|e| BodyError::Client(format!("cannot send 100 Continue: {e}")))?;
    }
    let mut body = BytesMut::with_capacity(declared.unwrap_or(0).min(limit) as usize);
    loop {
        match session.read_request_body().await {
            Ok(Some(chunk)) => {
                if (body.len() + chunk.len()) as u64 > limit {
                    return Err(too_large(format!("more than {limit}")));
                }
                body.extend_from_slice(&chunk);
            }
            Ok(None) => return Ok(body.freeze()),
            Err(e) => return Err(BodyError::Client(format!("reading request body: {e}"))),
        }
    }
}
