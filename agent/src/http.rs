//! A small HTTP/1 client for loopback and data-centre links: one connection per request,
//! a deadline on the whole exchange. Enough for health checks, metrics scrapes and reports.

use bytes::Bytes;
pub use http::Method;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("bad URL `{0}` (expected http://HOST:PORT[/PATH])")]
    Url(String),
    #[error("{0}: {1}")]
    Io(String, String),
    #[error("{0}: no answer within {1:?}")]
    Timeout(String, Duration),
}

/// `base` (`http://host:port`) joined with `path`, split into the address and the request
/// target.
fn split(base: &str, path: &str) -> Result<(String, String), HttpError> {
    let rest = base
        .strip_prefix("http://")
        .ok_or_else(|| HttpError::Url(base.to_string()))?;
    let (authority, prefix) = match rest.find('/') {
        Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
        None => (rest, ""),
    };
    if authority.is_empty() || !authority.contains(':') {
        return Err(HttpError::Url(base.to_string()));
    }
    Ok((authority.to_string(), format!("{prefix}{path}")))
}

/// Sends one request; returns the status and the whole body.
pub async fn request(
    method: http::Method,
    base: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<Vec<u8>>,
    timeout: Duration,
) -> Result<(u16, Bytes), HttpError> {
    let (authority, target) = split(base, path)?;
    let url = format!("{base}{path}");
    let exchange = async {
        let io_err = |e: &dyn std::fmt::Display| HttpError::Io(url.clone(), e.to_string());
        let stream = tokio::net::TcpStream::connect(&authority)
            .await
            .map_err(|e| io_err(&e))?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| io_err(&e))?;
        tokio::spawn(conn);
        let mut req = http::Request::builder()
            .method(method)
            .uri(&target)
            .header(http::header::HOST, &authority);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let req = req
            .body(Full::new(Bytes::from(body.unwrap_or_default())))
            .map_err(|e| io_err(&e))?;
        let resp = sender.send_request(req).await.map_err(|e| io_err(&e))?;
        let status = resp.status().as_u16();
        let bytes = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| io_err(&e))?
            .to_bytes();
        Ok((status, bytes))
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| HttpError::Timeout(url.clone(), timeout))?
}

/// `GET base+path`, the body as text when the status is 200.
pub async fn get_text(base: &str, path: &str, timeout: Duration) -> Result<String, HttpError> {
    let (status, body) = request(http::Method::GET, base, path, &[], None, timeout).await?;
    if status != 200 {
        return Err(HttpError::Io(
            format!("{base}{path}"),
            format!("status {status}"),
        ));
    }
    Ok(String::from_utf8_lossy(&body).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_split_into_address_and_target() {
        let ok = |b: &str, p: &str| split(b, p).ok();
        assert_eq!(
            ok("http://127.0.0.1:9001", "/stats"),
            Some(("127.0.0.1:9001".into(), "/stats".into()))
        );
        assert_eq!(
            ok("http://host:80/api/", "/metrics"),
            Some(("host:80".into(), "/api/metrics".into()))
        );
        assert!(split("https://host:443", "/").is_err());
        assert!(split("http://host", "/").is_err());
        assert!(split("http://", "/").is_err());
    }
}
