//! The floor under the gateway's hot path: a Pingora app that forwards each request to one
//! upstream the way the gateway does (Pingora's HTTP/1 sessions on both sides, the header and
//! body in one write, a per-thread pool of idle connections, the answer streamed back), with
//! none of the gateway's own work: no JSON, routing, tenants, metrics or logging. What the
//! gateway costs beyond this is its own; what this costs beyond nginx is Pingora's and tokio's.
//!
//! It takes the gateway's command line, reading `listen`, `threads` and the first replica's
//! `url` from the config, so that `bench/proxy/ab.py` runs it beside kvgate builds:
//! `cargo build --release --example pingora_floor`, then
//! `bench/proxy/ab.py floor=target/release/examples/pingora_floor:1 kvgate=target/release/kvgate:1`.

use async_trait::async_trait;
use pingora_core::apps::{HttpPersistentSettings, HttpServerApp, ReusedHttpStream};
use pingora_core::connectors::http::Connector;
use pingora_core::protocols::http::client::HttpSession;
use pingora_core::protocols::http::v1::client::HttpSession as Http1Session;
use pingora_core::protocols::http::ServerSession;
use pingora_core::protocols::Stream;
use pingora_core::server::configuration::ServerConf;
use pingora_core::server::{Server, ShutdownWatch};
use pingora_core::services::listening::Service;
use pingora_core::upstreams::peer::HttpPeer;
use std::cell::RefCell;
use std::sync::Arc;
use tokio::io::AsyncWriteExt;

#[cfg(not(target_env = "msvc"))]
#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

thread_local! {
    static IDLE: RefCell<Vec<Stream>> = const { RefCell::new(Vec::new()) };
}

struct Floor {
    peer: HttpPeer,
    authority: String,
    connector: Connector,
}

impl Floor {
    /// The request as the gateway writes it: the client's header less its framing, then the
    /// body, in one buffer.
    fn render(&self, client: &ServerSession, body: &[u8]) -> Vec<u8> {
        let header = client.req_header();
        let mut wire = Vec::with_capacity(512 + body.len());
        let path = header.uri.path_and_query().map_or("/", |p| p.as_str());
        wire.extend_from_slice(format!("{} {path} HTTP/1.1\r\n", header.method).as_bytes());
        for (name, value) in &header.headers {
            if name != http::header::HOST && name != http::header::CONTENT_LENGTH {
                wire.extend_from_slice(name.as_str().as_bytes());
                wire.extend_from_slice(b": ");
                wire.extend_from_slice(value.as_bytes());
                wire.extend_from_slice(b"\r\n");
            }
        }
        let framing = format!(
            "host: {}\r\ncontent-length: {}\r\n\r\n",
            self.authority,
            body.len()
        );
        wire.extend_from_slice(framing.as_bytes());
        wire.extend_from_slice(body);
        wire
    }

    async fn forward(&self, client: &mut ServerSession) -> Option<()> {
        let mut body = Vec::new();
        while let Some(chunk) = client.read_request_body().await.ok()? {
            body.extend_from_slice(&chunk);
        }
        let wire = self.render(client, &body);
        let mut stream = match IDLE.with(|idle| idle.borrow_mut().pop()) {
            Some(stream) => stream,
            None => match self.connector.get_http_session(&self.peer).await.ok()? {
                (HttpSession::H1(session), _) => session.into_inner(),
                _ => return None,
            },
        };
        stream.write_all(&wire).await.ok()?;
        stream.flush().await.ok()?;
        let mut upstream = Http1Session::new_with_options(stream, &self.peer);
        upstream.read_response().await.ok()?;
        let header = upstream.resp_header()?.clone();
        client.write_response_header(Box::new(header)).await.ok()?;
        while let Some(chunk) = upstream.read_body_bytes().await.ok()? {
            client.write_response_body(chunk, false).await.ok()?;
        }
        client.finish_body().await.ok()?;
        upstream.respect_keepalive();
        if let Some(stream) = upstream.reuse().await {
            IDLE.with(|idle| idle.borrow_mut().push(stream));
        }
        Some(())
    }
}

#[async_trait]
impl HttpServerApp for Floor {
    async fn process_new_http(
        self: &Arc<Self>,
        mut client: ServerSession,
        _shutdown: &ShutdownWatch,
    ) -> Option<ReusedHttpStream> {
        if !client.read_request().await.ok()? {
            return None;
        }
        self.forward(&mut client).await?;
        let settings = HttpPersistentSettings::for_session(&client);
        let stream = client.finish().await.ok()??;
        Some(ReusedHttpStream::from_reusable_stream(stream, settings))
    }
}

/// `listen`, `threads` and the first replica's URL from `gateway --config FILE`'s config, read
/// by the gateway's own loader (its defaults and checks).
fn settings() -> Result<(Vec<String>, usize, String), String> {
    let args: Vec<String> = std::env::args().collect();
    let path = match args.as_slice() {
        [_, command, flag, path] if command == "gateway" && flag == "--config" => path,
        _ => return Err("usage: pingora_floor gateway --config FILE".into()),
    };
    let config = kvgate_router::config::load_file(std::path::Path::new(path))
        .map_err(|errors| {
            let lines: Vec<String> = errors.iter().map(|e| format!("{path}: {e}")).collect();
            lines.join("\n")
        })?
        .config;
    let url = &config
        .replicas
        .first()
        .ok_or("the config names no replica")?
        .url;
    let authority = url.trim_start_matches("http://").trim_end_matches('/');
    Ok((
        config.listen.addresses().to_vec(),
        config.threads,
        authority.to_string(),
    ))
}

fn main() -> Result<(), String> {
    let (listen, threads, authority) = settings()?;
    let floor = Floor {
        peer: HttpPeer::new(authority.as_str(), false, String::new()),
        authority,
        connector: Connector::new(None),
    };
    let conf = ServerConf {
        threads,
        work_stealing: false,
        ..ServerConf::default()
    };
    let mut server = Server::new_with_opt_and_conf(None, conf);
    server.bootstrap();
    let mut service = Service::new("pingora floor".into(), floor);
    for address in &listen {
        service.add_tcp(address);
    }
    server.add_service(service);
    server.run_forever()
}
