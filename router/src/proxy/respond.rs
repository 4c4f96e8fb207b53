//! Answers the gateway writes itself: JSON bodies and OpenAI-style errors.

use bytes::Bytes;
use kvgate_protocol::ApiError;
use pingora_core::protocols::http::ServerSession;
use pingora_http::ResponseHeader;

/// Writes a complete response. Returns false if the client could not be written to.
pub async fn send(
    session: &mut ServerSession,
    status: u16,
    content_type: &str,
    body: Vec<u8>,
    headers: &[(&'static str, String)],
) -> bool {
    let Ok(mut header) = ResponseHeader::build(status, Some(4 + headers.len())) else {
        return false;
    };
    let mut ok = header.insert_header("content-type", content_type).is_ok()
        && header
            .insert_header("content-length", body.len().to_string())
            .is_ok();
    for (name, value) in headers {
        ok &= header.insert_header(*name, value.as_str()).is_ok();
    }
    if !ok {
        tracing::warn!("could not build response header");
    }
    if session
        .write_response_header(Box::new(header))
        .await
        .is_err()
    {
        return false;
    }
    if !body.is_empty()
        && session
            .write_response_body(Bytes::from(body), true)
            .await
            .is_err()
    {
        return false;
    }
    session.finish_body().await.is_ok()
}

pub async fn send_json(
    session: &mut ServerSession,
    status: u16,
    body: Vec<u8>,
    headers: &[(&'static str, String)],
) -> bool {
    send(session, status, "application/json", body, headers).await
}

/// Sends an OpenAI-style error; 503 and 429 carry `Retry-After` (one second).
pub async fn send_error(session: &mut ServerSession, error: &ApiError, request_id: &str) -> bool {
    send_error_after(session, error, request_id, None).await
}

/// [`send_error`] with the `Retry-After` a 503 or 429 carries, in whole seconds (at least 1).
pub async fn send_error_after(
    session: &mut ServerSession,
    error: &ApiError,
    request_id: &str,
    retry_after: Option<std::time::Duration>,
) -> bool {
    send_error_with(session, error, request_id, retry_after, Vec::new()).await
}

/// [`send_error_after`] with more headers.
pub async fn send_error_with(
    session: &mut ServerSession,
    error: &ApiError,
    request_id: &str,
    retry_after: Option<std::time::Duration>,
    extra: Vec<(&'static str, String)>,
) -> bool {
    let mut headers = vec![("x-request-id", request_id.to_string())];
    headers.extend(extra);
    if matches!(error.status(), 503 | 429) {
        let seconds = retry_after.map_or(1, |d| d.as_secs_f64().ceil().max(1.0) as u64);
        headers.push(("retry-after", seconds.to_string()));
    }
    send_json(session, error.status(), error.to_json(), &headers).await
}
