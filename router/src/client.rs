//! The gateway's own HTTP calls (health checks, model discovery, pushes to peer gateways):
//! one request on the shared connector, within a deadline, its response body bounded.

use crate::config::Upstream;
use bytes::{Bytes, BytesMut};
use pingora_core::connectors::http::Connector;
use pingora_core::upstreams::peer::HttpPeer;
use pingora_http::RequestHeader;
use std::time::Duration;

/// Largest response body read.
const MAX_BODY: usize = 1 << 20;

/// Where to connect: TLS for an `https://` upstream, its certificate checked for its host.
pub fn http_peer(up: &Upstream, connect: Duration, pool_idle: Option<Duration>) -> HttpPeer {
    let mut peer = HttpPeer::new(up.addr, up.tls, up.host.clone());
    peer.options.connection_timeout = Some(connect);
    peer.options.idle_timeout = pool_idle;
    peer
}

/// One request, answered within `timeout`: `method path` with `headers` and `body` (a
/// `content-length` is added for it); the status and the response body.
pub async fn call(
    connector: &Connector,
    up: &Upstream,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<Bytes>,
    timeout: Duration,
) -> Result<(u16, Bytes), String> {
    let exchange = async {
        let peer = http_peer(up, timeout, None);
        let (mut session, _) = connector
            .get_http_session(&peer)
            .await
            .map_err(|e| e.to_string())?;
        let mut req =
            RequestHeader::build(method, path.as_bytes(), Some(2)).map_err(|e| e.to_string())?;
        let length = body.as_ref().map(|b| b.len().to_string());
        let all = std::iter::once(("host", up.authority.as_str()))
            .chain(headers.iter().copied())
            .chain(length.as_deref().map(|l| ("content-length", l)));
        for (name, value) in all {
            req.insert_header(name.to_string(), value)
                .map_err(|e| e.to_string())?;
        }
        session
            .write_request_header(Box::new(req))
            .await
            .map_err(|e| e.to_string())?;
        if let Some(body) = body {
            session
                .write_request_body(body, false)
                .await
                .map_err(|e| e.to_string())?;
        }
        session
            .finish_request_body()
            .await
            .map_err(|e| e.to_string())?;
        session
            .read_response_header()
            .await
            .map_err(|e| e.to_string())?;
        let status = session.response_header().map_or(0, |h| h.status.as_u16());
        let mut body = BytesMut::new();
        while let Some(chunk) = session
            .read_response_body()
            .await
            .map_err(|e| e.to_string())?
        {
            if body.len() + chunk.len() > MAX_BODY {
                return Err(format!("{path} response over {MAX_BODY} bytes"));
            }
            body.extend_from_slice(&chunk);
        }
        connector
            .release_http_session(session, &peer, Some(Duration::from_secs(5)))
            .await;
        Ok((status, body.freeze()))
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| format!("{path} timed out after {timeout:?}"))?
}
