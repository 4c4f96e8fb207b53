//! The write buffer Pingora's listener gives each connection it accepts, for a connection
//! registered anew with its serving thread (see `this_thread.rs`), which Pingora would build
//! without one. Unbuffered, a response's header and a whole body leave in two system calls and
//! two segments, each waking the client; buffered, Pingora's session flushes them as one.

use async_trait::async_trait;
use pingora_core::listeners::DEFAULT_L4_WRITE_BUFFER_SIZE;
use pingora_core::protocols::l4::stream::Stream as L4Stream;
use pingora_core::protocols::raw_connect::ProxyDigest;
use pingora_core::protocols::{
    GetProxyDigest, GetSocketDigest, GetTimingDigest, Peek, Shutdown, SocketDigest, Ssl,
    TimingDigest, UniqueID, UniqueIDType,
};
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, BufWriter, ReadBuf};

/// A TCP connection whose writes wait in a buffer of one segment's size until the session
/// flushes (Pingora flushes each streamed chunk and the end of every body).
#[derive(Debug)]
pub struct WriteBuffered(BufWriter<L4Stream>);

impl WriteBuffered {
    pub fn new(stream: L4Stream) -> Self {
        WriteBuffered(BufWriter::with_capacity(
            DEFAULT_L4_WRITE_BUFFER_SIZE,
            stream,
        ))
    }

    fn stream(&self) -> &L4Stream {
        self.0.get_ref()
    }
}

impl AsyncRead for WriteBuffered {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_read(cx, buf)
    }
}

impl AsyncWrite for WriteBuffered {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_shutdown(cx)
    }
}

#[async_trait]
impl Shutdown for WriteBuffered {
    async fn shutdown(&mut self) {
        // The buffer's bytes go out first.
        if let Err(e) = AsyncWriteExt::shutdown(&mut self.0).await {
            tracing::debug!(error = %e, "shutting a client connection down failed");
        }
    }
}

#[async_trait]
impl Peek for WriteBuffered {
    async fn try_peek(&mut self, buf: &mut [u8]) -> io::Result<bool> {
        self.0.get_mut().try_peek(buf).await
    }
}

impl UniqueID for WriteBuffered {
    fn id(&self) -> UniqueIDType {
        self.stream().id()
    }
}

impl Ssl for WriteBuffered {}

impl GetTimingDigest for WriteBuffered {
    fn get_timing_digest(&self) -> Vec<Option<TimingDigest>> {
        self.stream().get_timing_digest()
    }

    fn get_read_pending_time(&self) -> Duration {
        self.stream().get_read_pending_time()
    }

    fn get_write_pending_time(&self) -> Duration {
        self.stream().get_write_pending_time()
    }
}

impl GetProxyDigest for WriteBuffered {
    fn get_proxy_digest(&self) -> Option<Arc<ProxyDigest>> {
        self.stream().get_proxy_digest()
    }

    fn set_proxy_digest(&mut self, digest: ProxyDigest) {
        self.0.get_mut().set_proxy_digest(digest)
    }
}

impl GetSocketDigest for WriteBuffered {
    fn get_socket_digest(&self) -> Option<Arc<SocketDigest>> {
        self.stream().get_socket_digest()
    }

    fn set_socket_digest(&mut self, digest: SocketDigest) {
        self.0.get_mut().set_socket_digest(digest)
    }
}
