//! Sending a request to the ranked replicas and streaming the answer back.
//!
//! The body is in memory, so a connect failure, a stale pooled connection or a 503/429 that
//! arrives before anything reached the client moves the request to the next replica. Once the
//! first byte is written to the client the request is never retried: a failure mid-stream ends
//! an SSE stream with an error event, or closes a non-streamed response.

use super::answer_end::AnswerEnd;
use super::gather::gather;
use super::respond;
use super::upstream_wire;
use crate::gateway::{Gateway, Route, Snapshot};
use crate::in_flight::InFlight;
use crate::replica::Replica;
use crate::tenants::Lease;
use bytes::Bytes;
use kvgate_policies::{Candidate, FailureOutcome, RequestFeatures};
use kvgate_protocol::openai::Endpoint;
use kvgate_protocol::{ApiError, ErrorKind};
use pingora_core::protocols::http::client::HttpSession;
use pingora_core::protocols::http::v1::client::HttpSession as Http1Session;
use pingora_core::protocols::http::ServerSession;
use pingora_core::protocols::Stream;
use pingora_core::upstreams::peer::{HttpPeer, Peer};
use pingora_core::ErrorType;
use pingora_http::ResponseHeader;
use std::time::{Duration, Instant};

/// How the client side ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// A full response was written; the connection may be reused.
    Complete,
    /// The client left or the response could not be completed: close the connection.
    Close,
}

impl Outcome {
    /// `Complete` when the whole response was `written`.
    pub fn of(written: bool) -> Self {
        if written {
            Outcome::Complete
        } else {
            Outcome::Close
        }
    }
}

/// Everything about the request that the attempts share.
pub struct Forward<'a> {
    pub gateway: &'a Gateway,
    pub snapshot: &'a Snapshot,
    pub endpoint: Endpoint,
    pub body: Bytes,
    pub features: &'a RequestFeatures,
    pub request_id: &'a str,
    pub started: Instant,
    pub debug: bool,
    /// The tenant's count of this request in flight, released as the answer ends.
    pub tenant_slot: Option<&'a Lease>,
}

enum Attempt {
    Done(Outcome, u16),
    /// Nothing reached the client: the next replica may take the request.
    Retry {
        reason: &'static str,
        error: ApiError,
    },
}

impl Forward<'_> {
    pub async fn run(&self, client: &mut ServerSession, route: Route) -> Outcome {
        let attempts = self.snapshot.config.retries.attempts as usize;
        let route_label = self.endpoint.path();
        let mut first = Some(route.first);
        let mut last_error =
            ApiError::new(ErrorKind::Unavailable, "no replica could take the request");
        for (i, (replica, candidate)) in route.ranked.iter().enumerate().take(attempts) {
            let mut in_flight = match first.take() {
                Some(guard) => guard,
                None => self.gateway.resend(candidate, self.features),
            };
            let more = i + 1 < attempts.min(route.ranked.len());
            match self
                .attempt(client, replica, candidate, &mut in_flight, more)
                .await
            {
                Attempt::Done(outcome, status) => {
                    drop(in_flight);
                    self.count(route_label, status, &replica.name);
                    return outcome;
                }
                Attempt::Retry { reason, error } => {
                    tracing::info!(replica = %replica.name, reason, "moving request to the next replica");
                    self.gateway
                        .metrics
                        .retries
                        .with_label_values(&[reason])
                        .inc();
                    last_error = error;
                }
            }
        }
        self.count(route_label, last_error.status(), "none");
        self.answered();
        Outcome::of(respond::send_error(client, &last_error, self.request_id).await)
    }

    /// The answer's last bytes are about to go out: what follows (the upstream connection's
    /// reuse, metrics) is the gateway's, not the client's, request.
    fn answered(&self) {
        if let Some(slot) = self.tenant_slot {
            slot.release();
        }
    }

    fn count(&self, route: &str, status: u16, replica: &str) {
        let m = &self.gateway.metrics;
        m.requests
            .with_label_values(&[route, &status.to_string(), replica])
            .inc();
        m.e2e
            .with_label_values(&[route])
            .observe(self.started.elapsed().as_secs_f64());
    }

    fn failed(&self, replica: &Replica, kind: &str) {
        self.gateway
            .metrics
            .upstream_errors
            .with_label_values(&[&replica.name, kind])
            .inc();
        if let FailureOutcome::Ejected(backoff_ms) = self
            .gateway
            .replica_failed(replica, &self.snapshot.config.health)
        {
            tracing::warn!(replica = %replica.name, backoff_ms, "replica ejected after consecutive failures");
            self.gateway
                .metrics
                .ejections
                .with_label_values(&[&replica.name])
                .inc();
        }
    }

    async fn attempt(
        &self,
        client: &mut ServerSession,
        replica: &Replica,
        candidate: &Candidate,
        in_flight: &mut InFlight,
        more_replicas: bool,
    ) -> Attempt {
        let timeouts = &self.snapshot.config.timeouts;
        let peer = replica.peer(
            Duration::from_millis(timeouts.connect_ms),
            Some(Duration::from_millis(timeouts.pool_idle_ms)),
        );
        let key = peer.reuse_hash();
        let mut upstream = match self.send(&peer, key, client, replica).await {
            Ok(upstream) => upstream,
            Err(attempt) => return attempt,
        };
        let Some(header) = upstream.response_header().cloned() else {
            self.failed(replica, "read");
            return self
                .fail_before_response(client, replica, "the replica sent no response header")
                .await;
        };
        let status = header.status.as_u16();
        if matches!(status, 503 | 429) && more_replicas {
            if status == 503 {
                self.failed(replica, "status_503");
            }
            let reason = if status == 503 {
                "status_503"
            } else {
                "status_429"
            };
            let error = ApiError::new(
                if status == 503 {
                    ErrorKind::Unavailable
                } else {
                    ErrorKind::RateLimited
                },
                format!("replica `{}` answered {status}", replica.name),
            );
            return Attempt::Retry { reason, error };
        }
        if status >= 500 {
            self.failed(replica, "status_5xx");
        }
        let mut response = self.client_header(header, client, replica, candidate);
        if client.req_header().version == http::Version::HTTP_10 {
            // HTTP/1.0 has no chunked encoding: the body ends when the connection does.
            response.remove_header("transfer-encoding");
            client.set_keepalive(None);
        }
        if client
            .write_response_header(Box::new(response))
            .await
            .is_err()
        {
            return Attempt::Done(Outcome::Close, 499);
        }
        let outcome = self
            .stream_body(client, &mut upstream, replica, in_flight, status < 500)
            .await;
        if outcome == Outcome::Complete && upstream.response_done() {
            if let HttpSession::H1(mut h1) = upstream {
                h1.respect_keepalive();
                if let Some(stream) = h1.reuse().await {
                    let max_idle = Duration::from_millis(timeouts.pool_idle_ms);
                    self.gateway.idle.put(key, stream, max_idle);
                }
            }
        }
        Attempt::Done(outcome, status)
    }

    /// A new connection to `peer` (HTTP/1: the peer offers no other), never a pooled one.
    async fn connect(&self, peer: &HttpPeer) -> pingora_core::Result<(Stream, bool)> {
        match self.gateway.connector().get_http_session(peer).await? {
            (HttpSession::H1(session), reused) => Ok((session.into_inner(), reused)),
            _ => pingora_core::Error::e_explain(ErrorType::ConnectProxyFailure, "not HTTP/1"),
        }
    }

    /// Connects (or takes an idle connection of this thread's to `key`, the peer's) and sends
    /// the request, reading the response header. A pooled connection the replica already
    /// closed is replaced by a fresh one.
    async fn send(
        &self,
        peer: &HttpPeer,
        key: u64,
        client: &mut ServerSession,
        replica: &Replica,
    ) -> Result<HttpSession, Attempt> {
        let timeouts = &self.snapshot.config.timeouts;
        let first_byte = Duration::from_millis(timeouts.first_byte_ms);
        let max_idle = Duration::from_millis(timeouts.pool_idle_ms);
        let client_req = client.req_header();
        let path = client_req
            .uri
            .path_and_query()
            .map_or(self.endpoint.path(), |p| p.as_str());
        let authority = &replica.upstream.authority;
        let request =
            upstream_wire::render(client_req, path, authority, self.request_id, &self.body);
        for _ in 0..3 {
            let pooled = self.gateway.idle.take(key, max_idle);
            let connected = match pooled {
                Some(stream) => Ok((stream, true)),
                // Boxed: connecting (TLS included) is a future of about 9 KB that every
                // request's state would carry and copy, though most take a pooled connection.
                None => Box::pin(self.connect(peer)).await,
            };
            let (stream, reused) = match connected {
                Ok(s) => s,
                Err(e) => {
                    self.failed(replica, "connect");
                    let error = ApiError::new(
                        ErrorKind::Unavailable,
                        format!("cannot connect to replica `{}`: {e}", replica.name),
                    );
                    return Err(Attempt::Retry {
                        reason: "connect",
                        error,
                    });
                }
            };
            let written = upstream_wire::write(stream, &request, first_byte).await;
            let mut upstream = match written {
                Ok(stream) => HttpSession::H1(Http1Session::new_with_options(stream, peer)),
                Err(e) => {
                    if reused {
                        self.gateway
                            .metrics
                            .retries
                            .with_label_values(&["stale_connection"])
                            .inc();
                        continue;
                    }
                    self.failed(replica, "write");
                    let error = ApiError::new(
                        ErrorKind::Unavailable,
                        format!("sending to replica `{}` failed: {e}", replica.name),
                    );
                    return Err(Attempt::Retry {
                        reason: "write",
                        error,
                    });
                }
            };
            upstream.set_read_timeout(Some(first_byte));
            let header = tokio::select! {
                biased;
                read = upstream.read_response_header() => read,
                _ = client.read_body_or_idle(true) => {
                    // The client left while the replica was still working on the prompt:
                    // dropping the upstream session closes its connection, which cancels it.
                    self.gateway.metrics.client_disconnects.inc();
                    return Err(Attempt::Done(Outcome::Close, 499));
                }
                _ = self.gateway.drain.grace_over() => {
                    return Err(self.fail_with(client, replica, super::shutting_down()).await);
                }
            };
            match header {
                Ok(()) => return Ok(upstream),
                Err(e) if reused && upstream.response_header().is_none() && !is_timeout(&e) => {
                    self.gateway
                        .metrics
                        .retries
                        .with_label_values(&["stale_connection"])
                        .inc();
                }
                Err(e) if is_timeout(&e) => {
                    self.failed(replica, "timeout");
                    let message = format!(
                        "replica `{}` sent no response within {first_byte:?}",
                        replica.name
                    );
                    let error = ApiError::new(ErrorKind::GatewayTimeout, message);
                    return Err(self.fail_with(client, replica, error).await);
                }
                Err(e) => {
                    // The replica died or answered garbage before a byte reached the client:
                    // the next one may take the request (a slow one is not retried, above, so
                    // that a long prompt is not computed twice).
                    self.failed(replica, "read");
                    let message =
                        format!("replica `{}` failed before responding: {e}", replica.name);
                    return Err(Attempt::Retry {
                        reason: "bad_response",
                        error: ApiError::new(ErrorKind::BadGateway, message),
                    });
                }
            }
        }
        let error = ApiError::new(
            ErrorKind::BadGateway,
            format!("replica `{}` keeps closing connections", replica.name),
        );
        Err(self.fail_with(client, replica, error).await)
    }

    async fn fail_before_response(
        &self,
        client: &mut ServerSession,
        replica: &Replica,
        message: &str,
    ) -> Attempt {
        let error = ApiError::new(ErrorKind::BadGateway, message);
        self.fail_with(client, replica, error).await
    }

    /// Answers an error of `replica`'s; the debug header names it.
    async fn fail_with(
        &self,
        client: &mut ServerSession,
        replica: &Replica,
        error: ApiError,
    ) -> Attempt {
        let status = error.status();
        let named = self
            .debug
            .then(|| ("x-kvgate-replica", replica.name.clone()));
        let sent = respond::send_error_with(
            client,
            &error,
            self.request_id,
            None,
            named.into_iter().collect(),
        )
        .await;
        let outcome = Outcome::of(sent);
        Attempt::Done(outcome, status)
    }

    fn client_header(
        &self,
        mut header: ResponseHeader,
        client: &ServerSession,
        replica: &Replica,
        candidate: &Candidate,
    ) -> ResponseHeader {
        upstream_wire::drop_hop_by_hop(&mut header);
        if client.is_http2() {
            header.remove_header("transfer-encoding");
        }
        let mut extra = vec![("x-request-id", self.request_id.to_string())];
        if self.debug {
            extra.push(("x-kvgate-replica", replica.name.clone()));
            extra.push(("x-kvgate-route", candidate.breakdown()));
        }
        for (name, value) in extra {
            if let Err(e) = header.insert_header(name, value) {
                tracing::warn!(error = %e, name, "cannot set response header");
            }
        }
        header
    }

    /// Copies the response body to the client chunk by chunk, watching for the client leaving.
    /// A whole body of a non-error answer is the replica's success: counted only then, so that
    /// a replica dropping its streams half-way does not reset its failures with each header.
    async fn stream_body(
        &self,
        client: &mut ServerSession,
        upstream: &mut HttpSession,
        replica: &Replica,
        in_flight: &mut InFlight,
        answer_ok: bool,
    ) -> Outcome {
        let idle = Duration::from_millis(self.snapshot.config.timeouts.idle_ms);
        let is_sse = upstream
            .response_header()
            .and_then(|h| h.headers.get(http::header::CONTENT_TYPE))
            .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
        let route = self.endpoint.path();
        let mut first_chunk = true;
        let mut end = AnswerEnd::new(is_sse);
        // Made once, not per chunk.
        let grace_over = self.gateway.drain.grace_over();
        tokio::pin!(grace_over);
        // A read that ended the last gathering, handled before anything more is read.
        let mut next = None;
        loop {
            let read = match next.take() {
                Some(read) => read,
                None => tokio::select! {
                    biased;
                    r = upstream.read_response_body() => r,
                    _ = client.read_body_or_idle(true) => {
                        // The client left: dropping the upstream session closes its connection,
                        // which cancels the generation on the replica.
                        self.gateway.metrics.client_disconnects.inc();
                        return Outcome::Close;
                    }
                    _ = &mut grace_over => {
                        if !is_sse {
                            return Outcome::Close;
                        }
                        return end_with_error(client, &super::shutting_down()).await;
                    }
                },
            };
            match read {
                Ok(Some(chunk)) => {
                    // A stream's chunks are its replica's steps; a whole body's reads are not.
                    if is_sse {
                        in_flight.token(self.gateway.now_us());
                    }
                    if first_chunk {
                        first_chunk = false;
                        in_flight.prefilled(self.gateway.now_ms());
                        self.gateway
                            .metrics
                            .ttft
                            .with_label_values(&[route])
                            .observe(self.started.elapsed().as_secs_f64());
                        upstream.set_read_timeout(Some(idle));
                    }
                    end.push(&chunk);
                    let chunk = match gather(upstream, chunk, &mut end) {
                        (chunk, Some(read)) => {
                            next = Some(read);
                            chunk
                        }
                        (chunk, None) => chunk,
                    };
                    // A body of known length ends with its last bytes, before `finish_body`
                    // (looked at only where a tenant's slot waits for the end).
                    if self.tenant_slot.is_some()
                        && (matches!(next, Some(Ok(None))) || upstream.response_done())
                    {
                        self.answered();
                    }
                    if let Err(e) = client.write_response_body(chunk, false).await {
                        self.gateway.metrics.client_disconnects.inc();
                        if e.etype() == &ErrorType::WriteTimedout {
                            self.gateway.metrics.client_send_timeouts.inc();
                        }
                        return Outcome::Close;
                    }
                }
                Ok(None) => {
                    self.answered();
                    if answer_ok && !end.is_whole() {
                        self.failed(replica, "garbled");
                        tracing::warn!(replica = %replica.name, "replica's answer did not end as a whole answer does");
                        // A blank line first ends whatever partial line the replica left.
                        if is_sse
                            && client
                                .write_response_body(Bytes::from_static(b"\n\n"), false)
                                .await
                                .is_ok()
                        {
                            let error = ApiError::new(
                                ErrorKind::BadGateway,
                                format!(
                                    "replica `{}` ended its stream without `[DONE]`",
                                    replica.name
                                ),
                            );
                            return end_with_error(client, &error).await;
                        }
                    } else if answer_ok {
                        self.gateway.replica_succeeded(replica);
                    }
                    return Outcome::of(client.finish_body().await.is_ok());
                }
                Err(e) => {
                    let timeout = is_timeout(&e);
                    self.failed(replica, if timeout { "timeout" } else { "read" });
                    tracing::warn!(replica = %replica.name, error = %e, "upstream failed mid-response");
                    if !is_sse {
                        return Outcome::Close;
                    }
                    let what = if timeout {
                        "stopped sending (idle timeout)"
                    } else {
                        "failed"
                    };
                    let error = ApiError::new(
                        if timeout {
                            ErrorKind::GatewayTimeout
                        } else {
                            ErrorKind::BadGateway
                        },
                        format!("replica `{}` {what} mid-stream: {e}", replica.name),
                    );
                    return end_with_error(client, &error).await;
                }
            }
        }
    }
}

/// Ends an SSE stream with an OpenAI-style error event, so the client knows it was cut short.
async fn end_with_error(client: &mut ServerSession, error: &ApiError) -> Outcome {
    let event = kvgate_protocol::openai::sse_event(&String::from_utf8_lossy(&error.to_json()));
    let ended = client
        .write_response_body(Bytes::from(event), false)
        .await
        .is_ok()
        && client.finish_body().await.is_ok();
    Outcome::of(ended)
}

fn is_timeout(e: &pingora_core::Error) -> bool {
    matches!(
        e.etype(),
        ErrorType::ReadTimedout | ErrorType::WriteTimedout
    )
}
