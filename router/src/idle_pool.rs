//! Idle connections to the replicas, kept per thread. A connection is registered with the
//! runtime of the thread that opened it and every read of it is dispatched there, so it is
//! reused only by requests on that thread. Pingora's own pool hands connections to any thread
//! and watches each idle one with a task spawned on a thread drawn at random: a thread hop and a
//! task per request. Here an idle connection is checked when it is taken instead: closed by the
//! replica, sent something unasked, or idle past its limit, it is dropped and the next is tried.

use futures::FutureExt;
use pingora_core::protocols::Stream;
use std::cell::RefCell;
use std::collections::HashMap;
use std::future::Future;
use std::time::{Duration, Instant};
use thread_local::ThreadLocal;
use tokio::io::AsyncReadExt;

/// Idle connections kept per replica and thread; the oldest go first beyond it.
pub const IDLE_PER_UPSTREAM: usize = 128;

#[derive(Default)]
pub struct IdlePool {
    threads: ThreadLocal<RefCell<HashMap<u64, Vec<Idle>>>>,
}

struct Idle {
    stream: Stream,
    since: Instant,
}

impl IdlePool {
    /// This thread's most recently used connection to upstream `key` that is still open and
    /// has idled at most `max_idle`.
    pub fn take(&self, key: u64, max_idle: Duration) -> Option<Stream> {
        let mut idle = self.threads.get_or_default().borrow_mut();
        let streams = idle.get_mut(&key)?;
        while let Some(Idle { mut stream, since }) = streams.pop() {
            if since.elapsed() <= max_idle && is_idle_and_open(&mut stream) {
                return Some(stream);
            }
        }
        None
    }

    /// Keeps a connection whose exchange ended cleanly for this thread's next request to `key`.
    pub fn put(&self, key: u64, mut stream: Stream, max_idle: Duration) {
        if !is_idle_and_open(&mut stream) {
            return;
        }
        let now = Instant::now();
        let mut idle = self.threads.get_or_default().borrow_mut();
        let streams = idle.entry(key).or_default();
        streams.retain(|i| now.duration_since(i.since) <= max_idle);
        if streams.len() >= IDLE_PER_UPSTREAM {
            streams.remove(0);
        }
        streams.push(Idle { stream, since: now });
    }

    /// Connections this thread keeps to `key`.
    #[cfg(test)]
    pub fn idle(&self, key: u64) -> usize {
        self.threads
            .get()
            .map_or(0, |t| t.borrow().get(&key).map_or(0, Vec::len))
    }
}

/// Whether nothing can be read from the connection yet: neither data the replica sent unasked
/// nor its end. Reads only what the runtime already knows is there (no system call otherwise).
fn is_idle_and_open(stream: &mut Stream) -> bool {
    let mut byte = [0u8; 1];
    now_or_never(stream.read(&mut byte)).is_none()
}

/// `future`'s output if it is ready at its first poll, without waiting. Unconstrained: a task
/// out of its cooperative budget would otherwise see nothing ready.
pub fn now_or_never<F: Future>(future: F) -> Option<F::Output> {
    tokio::task::unconstrained(future).now_or_never()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use pingora_core::protocols::l4::stream::Stream as TcpStream;
    use tokio::net::TcpListener;

    const LONG: Duration = Duration::from_secs(60);

    /// A connection as the gateway holds it, and the replica's end of it.
    async fn connection(listener: &TcpListener) -> (Stream, tokio::net::TcpStream) {
        let addr = listener.local_addr().unwrap();
        let ours = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (theirs, _) = listener.accept().await.unwrap();
        (Box::new(TcpStream::from(ours)), theirs)
    }

    fn on_one_thread(test: impl std::future::Future<Output = ()>) {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(test);
    }

    /// Lets the runtime's driver see what the peers did.
    async fn settle() {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    #[test]
    fn an_idle_connection_is_reused_and_a_closed_or_stale_one_is_not() {
        on_one_thread(async {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let pool = IdlePool::default();
            let (stream, replica) = connection(&listener).await;
            pool.put(1, stream, LONG);
            assert_eq!((pool.idle(1), pool.idle(2)), (1, 0));
            let stream = pool.take(1, LONG).expect("the idle connection");
            pool.put(1, stream, LONG);
            drop(replica);
            settle().await;
            assert!(pool.take(1, LONG).is_none(), "the replica closed it");

            let (stream, mut replica) = connection(&listener).await;
            pool.put(1, stream, LONG);
            tokio::io::AsyncWriteExt::write_all(&mut replica, b"HTTP/1.1 200 OK\r\n")
                .await
                .unwrap();
            settle().await;
            assert!(
                pool.take(1, LONG).is_none(),
                "the replica sent something unasked"
            );

            let (stream, _replica) = connection(&listener).await;
            pool.put(1, stream, LONG);
            settle().await;
            assert!(
                pool.take(1, Duration::from_millis(10)).is_none(),
                "idle too long"
            );
            assert_eq!(pool.idle(1), 0);
        });
    }

    #[test]
    fn at_most_so_many_are_kept_per_replica() {
        on_one_thread(async {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let pool = IdlePool::default();
            let mut replicas = Vec::new();
            for _ in 0..IDLE_PER_UPSTREAM + 2 {
                let (stream, replica) = connection(&listener).await;
                pool.put(7, stream, LONG);
                replicas.push(replica);
            }
            assert_eq!(pool.idle(7), IDLE_PER_UPSTREAM);
        });
    }
}
