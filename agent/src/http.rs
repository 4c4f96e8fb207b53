//! A small HTTP/1 client for loopback and data-centre links: one connection per request,
//! a deadline on the whole exchange, TLS (rustls) for `https://` URLs. Enough for health
//! checks, metrics scrapes and reports.

use bytes::Bytes;
pub use http::Method;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use pingora_rustls::{ClientConfig, RootCertStore, ServerName, TlsConnector};
use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};

/// What `https://` URLs are checked against: set by [`trust`], else the system's roots.
static TLS: OnceLock<Arc<ClientConfig>> = OnceLock::new();

/// Trusts the CA certificates in `ca_file` (PEM) for `https://` URLs instead of the system's.
/// Call before the first request.
pub fn trust(ca_file: &Path) -> Result<(), String> {
    let mut roots = RootCertStore::empty();
    pingora_rustls::load_ca_file_into_store(ca_file, &mut roots)
        .map_err(|e| format!("{}: {e}", ca_file.display()))?;
    TLS.set(client_config(roots))
        .map_err(|_| "the TLS trust is set already".to_string())
}

fn client_config(roots: RootCertStore) -> Arc<ClientConfig> {
    pingora_rustls::install_default_crypto_provider();
    Arc::new(
        ClientConfig::builder()
            .with_root_certificates(roots)
            .with_no_client_auth(),
    )
}

fn tls_config() -> Arc<ClientConfig> {
    Arc::clone(TLS.get_or_init(|| {
        let mut roots = RootCertStore::empty();
        if let Err(e) = pingora_rustls::load_platform_certs_incl_env_into_store(&mut roots) {
            tracing::warn!(error = %e, "cannot load the system's CA certificates");
        }
        client_config(roots)
    }))
}

#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("bad URL `{0}` (expected http://HOST:PORT[/PATH])")]
    Url(String),
    #[error("{0}: {1}")]
    Io(String, String),
    #[error("{0}: no answer within {1:?}")]
    Timeout(String, Duration),
}

/// Where a request goes.
#[derive(Debug, PartialEq, Eq)]
struct Target {
    authority: String,
    /// The request target: the base's path, then `path`.
    target: String,
    tls: bool,
}

/// `base` (`http(s)://host:port`) joined with `path`.
fn split(base: &str, path: &str) -> Result<Target, HttpError> {
    let (tls, rest) = match (base.strip_prefix("http://"), base.strip_prefix("https://")) {
        (Some(rest), _) => (false, rest),
        (_, Some(rest)) => (true, rest),
        _ => return Err(HttpError::Url(base.to_string())),
    };
    let (authority, prefix) = match rest.find('/') {
        Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
        None => (rest, ""),
    };
    if authority.is_empty() || !authority.contains(':') {
        return Err(HttpError::Url(base.to_string()));
    }
    Ok(Target {
        authority: authority.to_string(),
        target: format!("{prefix}{path}"),
        tls,
    })
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
    let Target {
        authority,
        target,
        tls,
    } = split(base, path)?;
    let url = format!("{base}{path}");
    let exchange = async {
        let io_err = |e: &dyn std::fmt::Display| HttpError::Io(url.clone(), e.to_string());
        let stream = tokio::net::TcpStream::connect(&authority)
            .await
            .map_err(|e| io_err(&e))?;
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
        if !tls {
            return send(stream, req).await.map_err(|e| io_err(&e));
        }
        let host = authority
            .rsplit_once(':')
            .map_or(authority.as_str(), |(h, _)| h)
            .trim_start_matches('[')
            .trim_end_matches(']');
        let name = ServerName::try_from(host.to_string()).map_err(|e| io_err(&e))?;
        let stream = TlsConnector::from(tls_config())
            .connect(name, stream)
            .await
            .map_err(|e| io_err(&e))?;
        send(stream, req).await.map_err(|e| io_err(&e))
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| HttpError::Timeout(url.clone(), timeout))?
}

/// One exchange on a connected stream: the status and the whole body.
async fn send<S>(stream: S, req: http::Request<Full<Bytes>>) -> Result<(u16, Bytes), String>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
    let status = resp.status().as_u16();
    let bytes = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    Ok((status, bytes))
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
        let ok = |b: &str, p: &str| split(b, p).ok().map(|t| (t.authority, t.target, t.tls));
        assert_eq!(
            ok("http://127.0.0.1:9001", "/stats"),
            Some(("127.0.0.1:9001".into(), "/stats".into(), false))
        );
        assert_eq!(
            ok("http://host:80/api/", "/metrics"),
            Some(("host:80".into(), "/api/metrics".into(), false))
        );
        assert_eq!(
            ok("https://host:443", "/"),
            Some(("host:443".into(), "/".into(), true))
        );
        assert!(split("ftp://host:21", "/").is_err());
        assert!(split("http://host", "/").is_err());
        assert!(split("http://", "/").is_err());
    }
}
