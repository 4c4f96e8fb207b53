//! Prefill/decode disaggregation's block transfer: a prefill worker keeps the K/V of the
//! prompts it computed for a decode worker (`store`), serves them over TCP (`serve`), and the
//! decode worker pulls the blocks it lacks (`pull`) before it generates.
//!
//! The exchange, one transfer per connection (integers big-endian):
//! ```text
//! decode  -> prefill  "KVT1" | transfer id u64
//! prefill -> decode   status u8 (0 ok, 1 unknown or expired) | n u32 | n x block hash u64
//! decode  -> prefill  k u32 | k x block index u32 (ascending; the blocks it lacks)
//! prefill -> decode   k x (hash u64 | length u32 | xxh3-64 of the bytes u64 | bytes)
//! ```
//! The hashes come first so the decode side checks them against its own prompt's chain and
//! asks only for the blocks it does not hold; every block carries its checksum, and the
//! whole exchange runs under the decode side's deadline.

mod pull;
mod serve;
mod store;
#[cfg(test)]
mod tests;
mod wire;

pub use pull::{pull, PullError, Pulled};
pub use serve::{serve, TransferServer};
pub use store::TransferStore;

use std::sync::Arc;

/// One block of a prompt's K/V, as the backend exported it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferBlock {
    pub hash: u64,
    /// The block before it in its chain (not sent: each side knows its own chain).
    pub parent: Option<u64>,
    /// Empty from a backend that only models K/V (the sim backend).
    pub data: Arc<[u8]>,
}

/// A prompt's leading blocks kept for one decode worker's pull.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transfer {
    pub blocks: Vec<TransferBlock>,
}

impl Transfer {
    pub fn bytes(&self) -> usize {
        self.blocks.iter().map(|b| b.data.len()).sum()
    }
}
