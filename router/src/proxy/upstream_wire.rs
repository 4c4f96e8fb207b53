//! The request as it goes to a replica, on the wire, and its one write there; the replica's
//! response header less what belongs to that connection.

use bytes::BytesMut;
use pingora_core::protocols::Stream;
use pingora_core::ErrorType;
use pingora_http::{RequestHeader, ResponseHeader};
use pingora_timeout::fast_timeout::fast_timeout;
use std::time::Duration;
use tokio::io::AsyncWriteExt;

/// Headers that describe one connection, not the message: never forwarded.
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "upgrade",
    "expect",
];

/// A replica's response header less the headers of its connection to the gateway. Only the
/// names present are removed: removing by name parses and hashes it, nine times a response.
pub(super) fn drop_hop_by_hop(header: &mut ResponseHeader) {
    let hop = |name: &&http::HeaderName| HOP_BY_HOP.contains(&name.as_str());
    while let Some(name) = header.headers.keys().find(hop).cloned() {
        header.remove_header(&name);
    }
}

/// The client's method, `path` and headers (less those of one connection and those set here),
/// the replica's `authority` as host, the body's length and the request id, then the body.
/// Every part was parsed from the client's request or the config, so none can break the
/// framing.
pub(super) fn render(
    client: &RequestHeader,
    path: &str,
    authority: &str,
    request_id: &str,
    body: &[u8],
) -> BytesMut {
    let mut wire = BytesMut::with_capacity(512 + body.len());
    let mut line = |parts: &[&[u8]]| {
        for part in parts {
            wire.extend_from_slice(part);
        }
        wire.extend_from_slice(b"\r\n");
    };
    line(&[
        client.method.as_str().as_bytes(),
        b" ",
        path.as_bytes(),
        b" HTTP/1.1",
    ]);
    for (name, value) in &client.headers {
        let skip = HOP_BY_HOP.contains(&name.as_str())
            || name == http::header::HOST
            || name == http::header::CONTENT_LENGTH
            || name == http::header::TRANSFER_ENCODING
            || name.as_str() == "x-request-id";
        if !skip {
            line(&[name.as_str().as_bytes(), b": ", value.as_bytes()]);
        }
    }
    line(&[b"host: ", authority.as_bytes()]);
    line(&[b"content-length: ", body.len().to_string().as_bytes()]);
    line(&[b"x-request-id: ", request_id.as_bytes()]);
    line(&[]);
    wire.extend_from_slice(body);
    wire
}

/// Sends the request, header and body, in one write: Pingora's session sends its header alone
/// first, which costs a system call and wakes the replica for a request it cannot yet read.
/// The session reading the response then sees no request written, which matters to it only for
/// `HEAD`, upgrades and `connection: close`, none of which the gateway forwards.
pub(super) async fn write(
    mut stream: Stream,
    request: &[u8],
    limit: Duration,
) -> pingora_core::Result<Stream> {
    let write = async {
        stream.write_all(request).await?;
        stream.flush().await
    };
    match fast_timeout(limit, write).await {
        Ok(Ok(())) => Ok(stream),
        Ok(Err(e)) => Err(pingora_core::Error::because(
            ErrorType::WriteError,
            "while writing the request",
            e,
        )),
        Err(_) => pingora_core::Error::e_explain(ErrorType::WriteTimedout, "writing the request"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_response_loses_its_connections_headers_and_keeps_the_rest() {
        let mut header = ResponseHeader::build(200, None).unwrap();
        for (name, value) in [
            ("Content-Type", "application/json"),
            ("Connection", "keep-alive"),
            ("Keep-Alive", "timeout=5"),
            ("X-Replica-Note", "kept"),
            ("Upgrade", "h2c"),
            ("Proxy-Authenticate", "Basic"),
            ("Trailer", "x-checksum"),
        ] {
            header.append_header(name, value).unwrap();
        }
        drop_hop_by_hop(&mut header);
        let names: Vec<&str> = header.headers.keys().map(|n| n.as_str()).collect();
        assert_eq!(names, ["content-type", "x-replica-note"]);
        // Gone from the header as written too, where the names' case is kept.
        let mut wire = Vec::new();
        header.header_to_h1_wire(&mut wire);
        let wire = String::from_utf8(wire).unwrap();
        assert_eq!(
            wire,
            "Content-Type: application/json\r\nX-Replica-Note: kept\r\n"
        );
    }
}
