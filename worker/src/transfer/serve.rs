//! The prefill side: answers decode workers' pulls from the store.

use super::{wire, TransferStore};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncWriteExt, BufReader, BufWriter};
use tokio::net::{TcpListener, TcpStream};

/// How long one pull may take from the prefill side's view: a decode worker that stalls
/// longer loses the connection (its own deadline is shorter).
const PULL_LIMIT: Duration = Duration::from_secs(60);

/// A bound transfer listener.
pub struct TransferServer {
    listener: TcpListener,
    addr: SocketAddr,
}

impl TransferServer {
    pub async fn bind(addr: SocketAddr) -> Result<TransferServer, String> {
        let cannot =
            |e: std::io::Error| format!("cannot listen for block transfers on {addr}: {e}");
        let listener = TcpListener::bind(addr).await.map_err(cannot)?;
        let addr = listener.local_addr().map_err(cannot)?;
        Ok(TransferServer { listener, addr })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

/// Serves pulls until the task is dropped; each connection on its own task.
pub async fn serve(server: TransferServer, store: Arc<TransferStore>) {
    loop {
        let stream = match server.listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::warn!(error = %e, "transfer accept failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let store = Arc::clone(&store);
        tokio::spawn(async move {
            match tokio::time::timeout(PULL_LIMIT, answer(stream, &store)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::debug!(error = %e, "block transfer ended early"),
                Err(_) => tracing::debug!("block transfer took too long: dropped"),
            }
        });
    }
}

async fn answer(stream: TcpStream, store: &TransferStore) -> std::io::Result<()> {
    let (read, write) = stream.into_split();
    let mut read = BufReader::new(read);
    let mut write = BufWriter::new(write);
    let id = wire::read_request(&mut read).await?;
    let Some(transfer) = store.take(id, Instant::now()) else {
        wire::write_hashes(&mut write, None).await?;
        return write.flush().await;
    };
    let hashes: Vec<u64> = transfer.blocks.iter().map(|b| b.hash).collect();
    wire::write_hashes(&mut write, Some(&hashes)).await?;
    write.flush().await?;
    for i in wire::read_wanted(&mut read, hashes.len()).await? {
        let block = &transfer.blocks[i as usize];
        wire::write_block(&mut write, block.hash, &block.data).await?;
    }
    write.flush().await
}
