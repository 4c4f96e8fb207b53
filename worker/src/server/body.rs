//! A response body fed through a bounded channel, so a producer task can stream it and learn
//! when the client has gone (the receiver is dropped).

use bytes::Bytes;
use http_body::{Body, Frame};
use std::pin::Pin;
use std::task::{Context, Poll};
use tokio::sync::mpsc;

pub type Chunk = Result<Frame<Bytes>, std::io::Error>;

pub struct ChannelBody(pub mpsc::Receiver<Chunk>);

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Chunk>> {
        self.0.poll_recv(cx)
    }
}

/// A body that is complete at once.
pub fn full(bytes: impl Into<Bytes>) -> ChannelBody {
    let (tx, rx) = mpsc::channel(1);
    // Capacity 1: this send cannot fail.
    let _ = tx.try_send(Ok(Frame::data(bytes.into())));
    ChannelBody(rx)
}
