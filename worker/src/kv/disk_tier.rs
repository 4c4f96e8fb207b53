//! The disk tier: blocks the host tier evicts, one file each in a directory the worker holds
//! locked while it runs, least recently used removed first, bounded in bytes. A file carries
//! its length and checksum; one that does not read back whole is dropped (its prefix is then
//! computed again), never served.

use super::offload::Offloaded;
use kvgate_protocol::kv_events::{KvEvent, Tier};
use lru::LruCache;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use xxhash_rust::xxh3::xxh3_64;

const MAGIC: &[u8; 4] = b"KVB1";
/// Magic, data length, checksum of the data.
const HEADER: usize = 4 + 8 + 8;
const LOCK_FILE: &str = "kvgate-worker.lock";
const EXTENSION: &str = "kvblock";

/// What the tier knows of a block without reading its file.
#[derive(Debug, Clone, Copy)]
struct OnDisk {
    parent: Option<u64>,
    bytes: usize,
}

#[derive(Debug)]
pub struct DiskTier {
    dir: PathBuf,
    /// Held (with its lock) for the tier's lifetime: one worker per directory.
    _lock: File,
    capacity_bytes: usize,
    used_bytes: usize,
    blocks: LruCache<u64, OnDisk>,
    events: Vec<KvEvent>,
    /// Blocks written since the start.
    stored_blocks: u64,
    /// Files that did not read back whole.
    failed_reads: u64,
}

impl DiskTier {
    /// Takes `dir` (created if missing) for a tier of `capacity_bytes`: locks it against
    /// other workers and removes the block files an earlier run left (their K/V may be of
    /// another model).
    pub fn open(dir: &Path, capacity_bytes: usize) -> Result<DiskTier, String> {
        let fail = |what: &str, e: std::io::Error| format!("{what} {}: {e}", dir.display());
        std::fs::create_dir_all(dir).map_err(|e| fail("cannot create", e))?;
        let lock = File::create(dir.join(LOCK_FILE)).map_err(|e| fail("cannot write in", e))?;
        lock.try_lock().map_err(|_| {
            format!(
                "{} is in use by another worker (its {LOCK_FILE} is locked)",
                dir.display()
            )
        })?;
        for entry in std::fs::read_dir(dir).map_err(|e| fail("cannot list", e))? {
            let path = entry.map_err(|e| fail("cannot list", e))?.path();
            if path.extension().is_some_and(|e| e == EXTENSION) {
                std::fs::remove_file(&path)
                    .map_err(|e| format!("cannot remove {}: {e}", path.display()))?;
            }
        }
        Ok(DiskTier {
            dir: dir.to_path_buf(),
            _lock: lock,
            capacity_bytes,
            used_bytes: 0,
            blocks: LruCache::unbounded(),
            events: Vec::new(),
            stored_blocks: 0,
            failed_reads: 0,
        })
    }

    fn path(&self, hash: u64) -> PathBuf {
        self.dir.join(format!("{hash:016x}.{EXTENSION}"))
    }

    pub fn capacity_bytes(&self) -> usize {
        self.capacity_bytes
    }

    pub fn used_bytes(&self) -> usize {
        self.used_bytes
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    pub fn stored_blocks(&self) -> u64 {
        self.stored_blocks
    }

    pub fn failed_reads(&self) -> u64 {
        self.failed_reads
    }

    pub fn contains(&self, hash: u64) -> bool {
        self.blocks.contains(&hash)
    }

    /// Writes a block to its file, removing the least recently used ones to make room. A
    /// block larger than the tier, already held, or whose file cannot be written is not kept.
    pub fn put(&mut self, hash: u64, block: &Offloaded) {
        let bytes = HEADER + block.data.len();
        if bytes > self.capacity_bytes || self.blocks.get(&hash).is_some() {
            return;
        }
        while self.used_bytes + bytes > self.capacity_bytes {
            let Some((old, _)) = self.blocks.peek_lru().map(|(&h, &b)| (h, b)) else {
                break;
            };
            self.remove(old);
        }
        if let Err(e) = write_block(&self.path(hash), &block.data) {
            tracing::warn!(error = %e, dir = %self.dir.display(), "disk tier: a block not written");
            let _ = std::fs::remove_file(self.path(hash));
            return;
        }
        self.used_bytes += bytes;
        self.stored_blocks += 1;
        self.blocks.put(
            hash,
            OnDisk {
                parent: block.parent,
                bytes,
            },
        );
        self.events.push(KvEvent::Stored {
            hashes: vec![hash],
            parent: block.parent,
            tier: Tier::Disk,
        });
    }

    /// Reads a block back (now the most recently used). A file that is missing, short, or
    /// fails its checksum is dropped from the tier: `None`, and the caller computes it.
    pub fn load(&mut self, hash: u64) -> Option<Offloaded> {
        let parent = self.blocks.get(&hash)?.parent;
        match read_block(&self.path(hash)) {
            Ok(data) => Some(Offloaded {
                parent,
                bytes: data.len(),
                data: data.into(),
            }),
            Err(e) => {
                tracing::warn!(error = %e, hash = format!("{hash:016x}"), "disk tier: a block dropped");
                self.failed_reads += 1;
                self.remove(hash);
                None
            }
        }
    }

    fn remove(&mut self, hash: u64) {
        if let Some(gone) = self.blocks.pop(&hash) {
            self.used_bytes -= gone.bytes;
            let _ = std::fs::remove_file(self.path(hash));
            self.events.push(KvEvent::Removed {
                hashes: vec![hash],
                tier: Tier::Disk,
            });
        }
    }

    /// Forgets every block and removes its file (a reset).
    pub fn clear(&mut self) {
        for hash in self.hashes() {
            self.remove(hash);
        }
    }

    /// Every held hash (a snapshot for KV-event subscribers).
    pub fn hashes(&self) -> Vec<u64> {
        self.blocks.iter().map(|(&h, _)| h).collect()
    }

    /// Events since the last call.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    /// The fastest of a few reads of a `bytes`-sized block file written to the tier's
    /// directory: what a load adds before the backend's import.
    pub fn time_read(&self, bytes: usize) -> Result<Duration, String> {
        const RUNS: usize = 3;
        let path = self.dir.join(format!("probe.{EXTENSION}"));
        let data: Vec<u8> = (0..bytes).map(|i| (i * 31 % 251) as u8).collect();
        write_block(&path, &data).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        let mut best = Duration::MAX;
        for _ in 0..RUNS {
            let started = Instant::now();
            let read = read_block(&path);
            best = best.min(started.elapsed());
            if let Err(e) = read {
                let _ = std::fs::remove_file(&path);
                return Err(format!("cannot read back {}: {e}", path.display()));
            }
        }
        let _ = std::fs::remove_file(&path);
        Ok(best)
    }
}

impl Drop for DiskTier {
    fn drop(&mut self) {
        for hash in self.hashes() {
            let _ = std::fs::remove_file(self.path(hash));
        }
    }
}

fn write_block(path: &Path, data: &[u8]) -> std::io::Result<()> {
    let mut file = File::create(path)?;
    let mut header = [0u8; HEADER];
    header[..4].copy_from_slice(MAGIC);
    header[4..12].copy_from_slice(&(data.len() as u64).to_le_bytes());
    header[12..].copy_from_slice(&xxh3_64(data).to_le_bytes());
    file.write_all(&header)?;
    file.write_all(data)
}

fn read_block(path: &Path) -> Result<Vec<u8>, String> {
    let mut raw = std::fs::read(path).map_err(|e| e.to_string())?;
    if raw.len() < HEADER || &raw[..4] != MAGIC {
        return Err("not a block file".into());
    }
    let word = |at: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&raw[at..at + 8]);
        u64::from_le_bytes(b)
    };
    let (len, sum) = (word(4), word(12));
    if raw.len() - HEADER != len as usize {
        return Err(format!("truncated: {} of {len} bytes", raw.len() - HEADER));
    }
    let data = raw.split_off(HEADER);
    if xxh3_64(&data) != sum {
        return Err("checksum mismatch".into());
    }
    Ok(data)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(parent: Option<u64>, fill: u8, size: usize) -> Offloaded {
        Offloaded {
            parent,
            data: vec![fill; size].into(),
            bytes: size,
        }
    }

    /// A new directory, removed with what is in it when dropped.
    fn temp_dir(name: &str) -> tempfile::TempDir {
        tempfile::Builder::new()
            .prefix(&format!("kvgate-disk-tier-{name}-"))
            .tempdir()
            .unwrap()
    }

    #[test]
    fn blocks_round_trip_and_the_least_recently_used_goes_first() {
        let dir = temp_dir("lru");
        let dir = dir.path();
        let mut tier = DiskTier::open(dir, 3 * (HEADER + 100)).unwrap();
        for h in 1..=3 {
            tier.put(h, &block((h > 1).then(|| h - 1), h as u8, 100));
        }
        assert_eq!(tier.load(1).unwrap(), block(None, 1, 100)); // 2 is now the oldest
        tier.put(4, &block(Some(3), 4, 100));
        assert!(!tier.contains(2) && tier.contains(1) && tier.contains(4));
        assert!(!tier.path(2).exists(), "its file is removed");
        assert_eq!(tier.used_bytes(), 3 * (HEADER + 100));
        let events = tier.take_events();
        assert!(events.contains(&KvEvent::Removed {
            hashes: vec![2],
            tier: Tier::Disk
        }));
        assert_eq!(
            events.last(),
            Some(&KvEvent::Stored {
                hashes: vec![4],
                parent: Some(3),
                tier: Tier::Disk
            })
        );
        drop(tier);
        assert!(
            !dir.join(format!("{:016x}.{EXTENSION}", 1)).exists(),
            "a closed tier leaves no block files"
        );
    }

    #[test]
    fn a_corrupted_truncated_or_missing_file_is_dropped_not_served() {
        let dir = temp_dir("corrupt");
        let dir = dir.path();
        let mut tier = DiskTier::open(dir, 1 << 20).unwrap();
        for h in 1..=3 {
            tier.put(h, &block(None, 7, 64));
        }
        let mut bytes = std::fs::read(tier.path(1)).unwrap();
        bytes[HEADER + 10] ^= 1;
        std::fs::write(tier.path(1), &bytes).unwrap();
        std::fs::write(tier.path(2), &bytes[..HEADER + 30]).unwrap();
        std::fs::remove_file(tier.path(3)).unwrap();
        tier.take_events();
        for h in 1..=3 {
            assert_eq!(tier.load(h), None, "block {h}");
            assert!(!tier.contains(h));
        }
        assert_eq!(tier.failed_reads(), 3);
        assert_eq!((tier.len(), tier.used_bytes()), (0, 0));
        assert_eq!(tier.take_events().len(), 3, "each announced as removed");
    }

    #[test]
    fn a_directory_is_one_workers_and_left_over_blocks_are_removed() {
        let dir = temp_dir("lock");
        let dir = dir.path();
        let left = dir.join(format!("{:016x}.{EXTENSION}", 9));
        std::fs::write(&left, b"from a killed worker").unwrap();
        std::fs::write(dir.join("notes.txt"), b"not ours").unwrap();
        let first = DiskTier::open(dir, 1 << 20).unwrap();
        assert!(!left.exists(), "a block file left over is removed");
        assert!(dir.join("notes.txt").exists(), "other files are left alone");
        let err = DiskTier::open(dir, 1 << 20).unwrap_err();
        assert!(err.contains("in use by another worker"), "{err}");
        drop(first);
        assert!(DiskTier::open(dir, 1 << 20).is_ok(), "free once closed");
    }

    #[test]
    fn the_probe_reads_a_block_and_leaves_nothing() {
        let dir = temp_dir("probe");
        let dir = dir.path();
        let tier = DiskTier::open(dir, 1 << 20).unwrap();
        assert!(tier.time_read(4096).unwrap() > Duration::ZERO);
        let files: Vec<_> = std::fs::read_dir(dir).unwrap().collect();
        assert_eq!(files.len(), 1, "only the lock file: {files:?}");
    }
}
