//! Wire contracts shared by every kvgate process: the OpenAI-compatible request, response and
//! streaming types, OpenAI-style error bodies, and the prefix hashes that let the gateway and
//! the workers name the same KV blocks.

pub mod error;
pub mod hash;
mod json_body;
pub mod kv_events;
pub mod openai;
pub mod responses;
pub mod sse;
pub mod telemetry;
pub mod worker_stats;

pub use error::{ApiError, ErrorBody, ErrorKind};
pub use hash::{block_hashes, extend_block_hashes, text_chunk_hashes, HashKeyMap, HashSeed};
