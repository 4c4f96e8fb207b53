//! Moves an accepted client connection onto the thread that serves it.
//!
//! Pingora accepts every connection on one thread's runtime and then runs it on one drawn at
//! random. A socket stays registered with the runtime that accepted it, so a connection served
//! by another thread has each read dispatched by the accepting thread, which then wakes the
//! serving one: a thread hand-off per read. Registering the socket again with the serving
//! thread's runtime, once per connection, keeps every read on the thread that handles it.
//! The moved connection gets the write buffer the listener would have given it.

use pingora_core::protocols::l4::socket::SocketAddr;
use pingora_core::protocols::l4::stream::Stream as L4Stream;
use pingora_core::protocols::{GetSocketDigest, SocketDigest, Stream};
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};

/// `stream`, registered with the current thread's runtime if it is a plain TCP connection
/// (TLS and Unix sockets are left where they are). A connection that cannot be moved stays
/// on the runtime that accepted it, which still serves it, only less directly.
pub fn to_this_thread(stream: Stream) -> Stream {
    let Some(tcp) = stream.as_any().downcast_ref::<L4Stream>() else {
        return stream;
    };
    // A Unix socket is an L4 stream too; only an IP peer's connection is moved, and the
    // address the listener recorded goes with it.
    let peer = tcp.get_socket_digest().and_then(|d| d.peer_addr().cloned());
    let Some(peer @ SocketAddr::Inet(_)) = peer else {
        return stream;
    };
    // The duplicate shares the original's file status, non-blocking included, as tokio needs.
    let Ok(socket) = duplicate(tcp) else {
        return stream;
    };
    // Reads and writes go through the duplicate from here on; dropping the original
    // deregisters it from the accepting runtime and closes its descriptor, not the socket.
    let Ok(socket) = tokio::net::TcpStream::from_std(std::net::TcpStream::from(socket)) else {
        return stream;
    };
    drop(stream);
    let mut moved = L4Stream::from(socket);
    let digest = SocketDigest::from_raw_fd(moved.as_raw_fd());
    let _ = digest.peer_addr.set(Some(peer));
    moved.set_socket_digest(digest);
    Box::new(super::write_buffered::WriteBuffered::new(moved))
}

/// A second descriptor of the connection's socket.
#[allow(unsafe_code)]
fn duplicate(tcp: &L4Stream) -> std::io::Result<OwnedFd> {
    // SAFETY: the descriptor belongs to `tcp`, which is borrowed for the whole call, so it
    // stays open while it is borrowed here.
    let fd = unsafe { BorrowedFd::borrow_raw(tcp.as_raw_fd()) };
    fd.try_clone_to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    /// A client connection accepted on a runtime of its own, the client's end, and that
    /// runtime.
    fn accepted_elsewhere() -> (Stream, std::net::TcpStream, tokio::runtime::Runtime) {
        let accepting = runtime();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        server.set_nonblocking(true).unwrap();
        let stream: Stream = accepting.block_on(async {
            let peer = server.peer_addr().unwrap();
            let mut s = L4Stream::from(tokio::net::TcpStream::from_std(server).unwrap());
            // As Pingora's listener records it.
            let digest = SocketDigest::from_raw_fd(s.as_raw_fd());
            digest.peer_addr.set(Some(SocketAddr::Inet(peer))).unwrap();
            s.set_socket_digest(digest);
            Box::new(s)
        });
        (stream, client, accepting)
    }

    #[test]
    fn a_moved_connection_is_served_without_the_runtime_that_accepted_it() {
        let (stream, mut client, accepting) = accepted_elsewhere();
        let peer = client.local_addr().unwrap();
        let serving = runtime();
        let mut stream = serving.block_on(async { to_this_thread(stream) });
        // The accepting runtime's I/O driver is gone: only a socket registered with the
        // serving runtime can still be read and written.
        drop(accepting);
        use std::io::{Read, Write};
        client.write_all(b"ping").unwrap();
        serving.block_on(async {
            let mut got = [0u8; 4];
            stream.read_exact(&mut got).await.unwrap();
            assert_eq!(&got, b"ping");
            stream.write_all(b"pong").await.unwrap();
            stream.flush().await.unwrap();
            let digest = stream.get_socket_digest().unwrap();
            assert_eq!(digest.peer_addr(), Some(&SocketAddr::Inet(peer)));
        });
        let mut got = [0u8; 4];
        client.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"pong");
        // One socket: closing the moved stream ends the client's connection.
        drop(stream);
        assert_eq!(client.read(&mut got).unwrap(), 0);
    }

    #[test]
    fn a_moved_connection_sends_what_it_writes_when_flushed_not_before() {
        let (stream, mut client, _accepting) = accepted_elsewhere();
        let serving = runtime();
        let mut stream = serving.block_on(async { to_this_thread(stream) });
        use std::io::Read;
        client
            .set_read_timeout(Some(std::time::Duration::from_millis(200)))
            .unwrap();
        let mut got = [0u8; 11];
        // A response's header and its whole body: written apart, sent together.
        serving.block_on(async { stream.write_all(b"header ").await.unwrap() });
        let early = client.read(&mut got).unwrap_err();
        assert_eq!(
            early.kind(),
            std::io::ErrorKind::WouldBlock,
            "sent before a flush"
        );
        serving.block_on(async {
            stream.write_all(b"body").await.unwrap();
            stream.flush().await.unwrap();
        });
        client.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"header body");
    }

    #[test]
    fn a_connection_that_is_not_tcp_is_left_as_it_is() {
        let serving = runtime();
        serving.block_on(async {
            let (a, _b) = tokio::net::UnixStream::pair().unwrap();
            let mut s = L4Stream::from(a);
            s.set_socket_digest(SocketDigest::from_raw_fd(s.as_raw_fd()));
            let stream: Stream = Box::new(s);
            let id = stream.id();
            let stream = to_this_thread(stream);
            assert_eq!(stream.id(), id);
        });
    }
}
