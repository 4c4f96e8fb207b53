//! The transfer exchange end to end over loopback: the real server and pull, and prefill
//! sides that misbehave (a corrupted block, a broken-off stream, silence).

use super::*;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

const DEADLINE: Duration = Duration::from_secs(5);

/// The blocks of test chains: hashes count up from one ending in 1, which has no parent.
fn blocks(hashes: &[u64]) -> Vec<TransferBlock> {
    hashes
        .iter()
        .map(|&hash| TransferBlock {
            hash,
            parent: (hash % 10 > 1).then(|| hash - 1),
            data: vec![hash as u8; 1000 + hash as usize].into(),
        })
        .collect()
}

/// A real transfer server holding `hashes`' blocks; returns its address and the id.
async fn prefill_side(hashes: &[u64]) -> (std::net::SocketAddr, u64, Arc<TransferStore>) {
    let store = Arc::new(TransferStore::new(1 << 20, Duration::from_secs(30)));
    let transfer = Transfer {
        blocks: blocks(hashes),
    };
    let id = store.keep(transfer, Instant::now()).unwrap();
    let server = TransferServer::bind("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let addr = server.local_addr();
    tokio::spawn(serve(server, Arc::clone(&store)));
    (addr, id, store)
}

/// A prefill side that reads the request, then writes `reply` and closes (or, with `hang`,
/// never closes).
async fn scripted_side(reply: Vec<u8>, hang: bool) -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.unwrap();
        let mut request = [0u8; 12];
        stream.read_exact(&mut request).await.unwrap();
        stream.write_all(&reply).await.unwrap();
        if hang {
            tokio::time::sleep(Duration::from_secs(60)).await;
        }
        let _ = stream.shutdown().await;
        let _ = stream.read_to_end(&mut Vec::new()).await;
    });
    addr
}

/// The bytes a prefill side sends for `hashes`, all wanted, with block `bad` corrupted and
/// the stream cut `cut` bytes short.
async fn reply_bytes(hashes: &[u64], bad: Option<usize>, cut: usize) -> Vec<u8> {
    let mut out = Vec::new();
    wire::write_hashes(&mut out, Some(hashes)).await.unwrap();
    for (i, block) in blocks(hashes).iter().enumerate() {
        let mut written = Vec::new();
        wire::write_block(&mut written, block.hash, &block.data)
            .await
            .unwrap();
        if bad == Some(i) {
            let last = written.len() - 1;
            written[last] ^= 0xff;
        }
        out.extend(written);
    }
    out.truncate(out.len() - cut);
    out
}

#[tokio::test]
async fn the_blocks_a_worker_lacks_arrive_intact_and_a_transfer_is_pulled_once() {
    let chain = [11, 12, 13, 14];
    let (addr, id, store) = prefill_side(&chain).await;
    let held = [true, false, false, false];
    let pulled = pull(addr, id, &chain, &held, DEADLINE, usize::MAX).await;
    assert_eq!(pulled.error, None);
    assert_eq!(pulled.skipped, 1);
    assert_eq!(pulled.blocks, blocks(&chain[1..]));
    assert_eq!(store.usage(), (0, 0));
    let again = pull(addr, id, &chain, &held, DEADLINE, usize::MAX).await;
    assert_eq!(again.error, Some(PullError::UnknownTransfer));
    assert!(again.blocks.is_empty());
}

#[tokio::test]
async fn only_the_run_that_matches_the_prompt_is_taken() {
    let (addr, id, _store) = prefill_side(&[11, 12, 99, 14]).await;
    let chain = [11, 12, 13, 14, 15];
    let pulled = pull(addr, id, &chain, &[false; 5], DEADLINE, usize::MAX).await;
    assert_eq!(pulled.error, Some(PullError::Mismatch { index: 2 }));
    assert_eq!(pulled.blocks, blocks(&[11, 12]));
}

#[tokio::test]
async fn a_corrupted_block_ends_the_pull_and_the_blocks_before_it_stay() {
    let chain = [21, 22, 23];
    let addr = scripted_side(reply_bytes(&chain, Some(1), 0).await, false).await;
    let pulled = pull(addr, 7, &chain, &[false; 3], DEADLINE, usize::MAX).await;
    assert_eq!(pulled.error, Some(PullError::Checksum { hash: 22 }));
    assert_eq!(pulled.blocks, blocks(&[21]));
}

#[tokio::test]
async fn a_transfer_that_breaks_off_keeps_only_whole_blocks() {
    let chain = [31, 32, 33];
    let addr = scripted_side(reply_bytes(&chain, None, 10).await, false).await;
    let pulled = pull(addr, 7, &chain, &[false; 3], DEADLINE, usize::MAX).await;
    assert!(
        matches!(pulled.error, Some(PullError::Truncated(_))),
        "{:?}",
        pulled.error
    );
    assert_eq!(pulled.blocks, blocks(&[31, 32]));
}

#[tokio::test]
async fn a_silent_prefill_side_costs_the_deadline_and_no_more() {
    let chain = [41, 42];
    let mut hashes_only = Vec::new();
    wire::write_hashes(&mut hashes_only, Some(&chain))
        .await
        .unwrap();
    let addr = scripted_side(hashes_only, true).await;
    let started = Instant::now();
    let deadline = Duration::from_millis(300);
    let pulled = pull(addr, 7, &chain, &[false; 2], deadline, usize::MAX).await;
    assert_eq!(pulled.error, Some(PullError::Deadline(deadline)));
    assert!(started.elapsed() < Duration::from_secs(3));
    assert!(pulled.blocks.is_empty());
}

#[tokio::test]
async fn an_unreachable_prefill_side_or_too_many_bytes_end_the_pull() {
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let pulled = pull(closed, 7, &[1], &[false], DEADLINE, usize::MAX).await;
    assert_eq!(pulled.error.map(|e| e.reason()), Some("unreachable"));
    let chain = [51, 52, 53];
    let (addr, id, _store) = prefill_side(&chain).await;
    let pulled = pull(addr, id, &chain, &[false; 3], DEADLINE, 2200).await;
    assert_eq!(pulled.error, Some(PullError::TooLarge(2200)));
    assert_eq!(pulled.blocks, blocks(&[51, 52]));
}

#[tokio::test]
async fn the_prefill_side_refuses_bad_requests() {
    let mut bad_magic = &b"KVT2\0\0\0\0\0\0\0\x07"[..];
    assert!(wire::read_request(&mut bad_magic).await.is_err());
    for wanted in [vec![1u32, 1], vec![2, 1], vec![5]] {
        let mut bytes = Vec::new();
        wire::write_wanted(&mut bytes, &wanted).await.unwrap();
        assert!(
            wire::read_wanted(&mut &bytes[..], 3).await.is_err(),
            "{wanted:?}"
        );
    }
    let mut too_many = Vec::new();
    wire::write_wanted(&mut too_many, &[0, 1, 2, 3])
        .await
        .unwrap();
    assert!(wire::read_wanted(&mut &too_many[..], 3).await.is_err());
}

proptest::proptest! {
    /// Whatever bytes a peer sends, every read ends in a value or an error, never a panic,
    /// and a read never takes more than the bytes it was given plus its fixed header.
    #[test]
    fn arbitrary_bytes_are_read_or_refused(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..2048)) {
        let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
        runtime.block_on(async {
            let _ = wire::read_request(&mut &bytes[..]).await;
            let _ = wire::read_wanted(&mut &bytes[..], wire::MAX_BLOCKS).await;
            if let Ok(Some(hashes)) = wire::read_hashes(&mut &bytes[..]).await {
                proptest::prop_assert!(hashes.len() * 8 + 5 <= bytes.len());
            }
            if let Ok(block) = wire::read_block(&mut &bytes[..]).await {
                proptest::prop_assert!(block.data.len() + 20 <= bytes.len());
            }
            Ok(())
        })?;
    }
}
