//! The transfer exchange's messages (see the module above) and their limits.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

pub const MAGIC: &[u8; 4] = b"KVT1";
pub const STATUS_OK: u8 = 0;
pub const STATUS_UNKNOWN: u8 = 1;
/// Most blocks one transfer may hold (a 1M-token prompt in 16-token blocks).
pub const MAX_BLOCKS: usize = 65_536;
/// Largest block either side accepts: bounds what one read may allocate.
pub const MAX_BLOCK_BYTES: usize = 64 << 20;
/// Entries reserved ahead of what has arrived.
const PREALLOCATED: usize = 4096;

pub async fn write_request(w: &mut (impl AsyncWrite + Unpin), id: u64) -> std::io::Result<()> {
    let mut out = Vec::with_capacity(12);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&id.to_be_bytes());
    w.write_all(&out).await
}

/// The transfer id a decode side asks for; an error for anything but the magic.
pub async fn read_request(r: &mut (impl AsyncRead + Unpin)) -> std::io::Result<u64> {
    let mut magic = [0u8; 4];
    r.read_exact(&mut magic).await?;
    if &magic != MAGIC {
        return Err(invalid("not a kvgate block transfer (bad magic)"));
    }
    r.read_u64().await
}

pub async fn write_hashes(
    w: &mut (impl AsyncWrite + Unpin),
    hashes: Option<&[u64]>,
) -> std::io::Result<()> {
    let Some(hashes) = hashes else {
        return w.write_all(&[STATUS_UNKNOWN, 0, 0, 0, 0]).await;
    };
    let mut out = Vec::with_capacity(5 + 8 * hashes.len());
    out.push(STATUS_OK);
    out.extend_from_slice(&(hashes.len() as u32).to_be_bytes());
    for h in hashes {
        out.extend_from_slice(&h.to_be_bytes());
    }
    w.write_all(&out).await
}

/// The transfer's block hashes, or `None` when the prefill side does not know the id.
pub async fn read_hashes(r: &mut (impl AsyncRead + Unpin)) -> std::io::Result<Option<Vec<u64>>> {
    let status = r.read_u8().await?;
    let n = r.read_u32().await? as usize;
    match status {
        STATUS_OK if n <= MAX_BLOCKS => {}
        STATUS_OK => return Err(invalid("a transfer of more blocks than allowed")),
        STATUS_UNKNOWN => return Ok(None),
        _ => return Err(invalid("unknown transfer status")),
    }
    // Grown as hashes arrive: a count alone reserves little.
    let mut hashes = Vec::with_capacity(n.min(PREALLOCATED));
    for _ in 0..n {
        hashes.push(r.read_u64().await?);
    }
    Ok(Some(hashes))
}

pub async fn write_wanted(
    w: &mut (impl AsyncWrite + Unpin),
    wanted: &[u32],
) -> std::io::Result<()> {
    let mut out = Vec::with_capacity(4 + 4 * wanted.len());
    out.extend_from_slice(&(wanted.len() as u32).to_be_bytes());
    for i in wanted {
        out.extend_from_slice(&i.to_be_bytes());
    }
    w.write_all(&out).await
}

/// The block indices the decode side wants: ascending, each below `n`.
pub async fn read_wanted(r: &mut (impl AsyncRead + Unpin), n: usize) -> std::io::Result<Vec<u32>> {
    let k = r.read_u32().await? as usize;
    if k > n {
        return Err(invalid("more blocks wanted than the transfer holds"));
    }
    let mut wanted = Vec::with_capacity(k.min(PREALLOCATED));
    for _ in 0..k {
        let i = r.read_u32().await?;
        if i as usize >= n || wanted.last().is_some_and(|&last| last >= i) {
            return Err(invalid(
                "wanted block indices must ascend within the transfer",
            ));
        }
        wanted.push(i);
    }
    Ok(wanted)
}

pub async fn write_block(
    w: &mut (impl AsyncWrite + Unpin),
    hash: u64,
    data: &[u8],
) -> std::io::Result<()> {
    let mut head = [0u8; 20];
    head[..8].copy_from_slice(&hash.to_be_bytes());
    head[8..12].copy_from_slice(&(data.len() as u32).to_be_bytes());
    head[12..].copy_from_slice(&checksum(data).to_be_bytes());
    w.write_all(&head).await?;
    w.write_all(data).await
}

/// One block as sent: its hash, bytes and whether they match the checksum sent with them.
pub struct ReceivedBlock {
    pub hash: u64,
    pub data: Vec<u8>,
    pub intact: bool,
}

pub async fn read_block(r: &mut (impl AsyncRead + Unpin)) -> std::io::Result<ReceivedBlock> {
    let hash = r.read_u64().await?;
    let len = r.read_u32().await? as usize;
    let sum = r.read_u64().await?;
    if len > MAX_BLOCK_BYTES {
        return Err(invalid("a block larger than allowed"));
    }
    // Read into what arrives, not a buffer of the announced length.
    let mut data = Vec::with_capacity(len.min(PREALLOCATED * 64));
    r.take(len as u64).read_to_end(&mut data).await?;
    if data.len() < len {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "a block cut short",
        ));
    }
    let intact = checksum(&data) == sum;
    Ok(ReceivedBlock { hash, data, intact })
}

pub fn checksum(data: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(data)
}

fn invalid(message: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, message)
}
