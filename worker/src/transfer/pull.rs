//! The decode side: pulls a transfer's blocks from the prefill worker that holds them.

use super::{wire, TransferBlock};
use std::net::SocketAddr;
use std::time::Duration;
use tokio::io::{AsyncWriteExt, BufReader, BufWriter};
use tokio::net::TcpStream;

/// Why a pull ended before every wanted block arrived intact. The blocks before the fault
/// are still good: each was checked against its checksum and the decode side's own chain.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PullError {
    #[error("cannot reach the prefill worker at {addr}: {error}")]
    Unreachable { addr: SocketAddr, error: String },
    #[error(
        "the prefill worker does not know this transfer (unknown, already pulled, or expired)"
    )]
    UnknownTransfer,
    #[error("the transfer's block {index} is not this prompt's: another prompt's transfer")]
    Mismatch { index: usize },
    #[error("block {hash:016x} failed its checksum")]
    Checksum { hash: u64 },
    #[error("the transfer broke off: {0}")]
    Truncated(String),
    #[error("the transfer did not finish within {0:?}")]
    Deadline(Duration),
    #[error("the transfer's blocks exceed the {0} bytes this worker takes at once")]
    TooLarge(usize),
}

impl PullError {
    /// A short label for metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            PullError::Unreachable { .. } => "unreachable",
            PullError::UnknownTransfer => "unknown_transfer",
            PullError::Mismatch { .. } => "mismatch",
            PullError::Checksum { .. } => "checksum",
            PullError::Truncated(_) => "truncated",
            PullError::Deadline(_) => "deadline",
            PullError::TooLarge(_) => "too_large",
        }
    }
}

/// What a pull brought: the blocks this worker lacked, each intact and of its own prompt, and
/// why it stopped early, if it did.
#[derive(Debug, Default)]
pub struct Pulled {
    pub blocks: Vec<TransferBlock>,
    /// Blocks the transfer offered that this worker held already.
    pub skipped: usize,
    pub error: Option<PullError>,
}

/// Pulls transfer `id` from `addr` within `deadline`. `chain` is this worker's own prompt's
/// block hashes and `held[i]` whether it holds block `i` already; only blocks that agree with
/// `chain` and are not held are asked for, and at most `max_bytes` of them are taken.
pub async fn pull(
    addr: SocketAddr,
    id: u64,
    chain: &[u64],
    held: &[bool],
    deadline: Duration,
    max_bytes: usize,
) -> Pulled {
    let mut pulled = Pulled::default();
    let exchange = exchange(addr, id, chain, held, max_bytes, &mut pulled);
    let error = match tokio::time::timeout(deadline, exchange).await {
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some(e),
        Err(_) => Some(PullError::Deadline(deadline)),
    };
    pulled.error = pulled.error.take().or(error);
    pulled
}

async fn exchange(
    addr: SocketAddr,
    id: u64,
    chain: &[u64],
    held: &[bool],
    max_bytes: usize,
    pulled: &mut Pulled,
) -> Result<(), PullError> {
    let stream = TcpStream::connect(addr)
        .await
        .map_err(|e| PullError::Unreachable {
            addr,
            error: e.to_string(),
        })?;
    let _ = stream.set_nodelay(true);
    let (read, write) = stream.into_split();
    let mut read = BufReader::new(read);
    let mut write = BufWriter::new(write);
    let broke = |e: std::io::Error| PullError::Truncated(e.to_string());
    wire::write_request(&mut write, id).await.map_err(broke)?;
    write.flush().await.map_err(broke)?;
    let offered = wire::read_hashes(&mut read)
        .await
        .map_err(broke)?
        .ok_or(PullError::UnknownTransfer)?;
    let agreeing = offered
        .iter()
        .zip(chain)
        .take_while(|(a, b)| a == b)
        .count();
    if agreeing < offered.len().min(chain.len()) {
        // Blocks past the first disagreement are another prompt's: only the run before it.
        pulled.error = Some(PullError::Mismatch { index: agreeing });
    }
    let wanted: Vec<u32> = (0..agreeing)
        .filter(|&i| !held.get(i).copied().unwrap_or(false))
        .map(|i| i as u32)
        .collect();
    pulled.skipped = agreeing - wanted.len();
    wire::write_wanted(&mut write, &wanted)
        .await
        .map_err(broke)?;
    write.flush().await.map_err(broke)?;
    let mut bytes = 0usize;
    for &i in &wanted {
        let block = wire::read_block(&mut read).await.map_err(broke)?;
        if block.hash != chain[i as usize] {
            return Err(PullError::Mismatch { index: i as usize });
        }
        if !block.intact {
            return Err(PullError::Checksum { hash: block.hash });
        }
        bytes += block.data.len();
        if bytes > max_bytes {
            return Err(PullError::TooLarge(max_bytes));
        }
        pulled.blocks.push(TransferBlock {
            hash: block.hash,
            parent: (i as usize).checked_sub(1).map(|p| chain[p]),
            data: block.data.into(),
        });
    }
    Ok(())
}
