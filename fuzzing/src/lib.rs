//! What each of kvgate's fuzz targets checks: a function per target that takes any bytes and
//! panics only when kvgate does something wrong with them (a crash, or a broken invariant). The
//! cargo-fuzz binaries in `fuzz/` call these; `tests/corpora.rs` replays the kept corpora
//! through them as an ordinary test.
// A check reports a broken invariant by panicking, which is what the fuzzer catches.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

mod kv_blocks;
mod parsers;
mod prefix_index;
mod tokenizer;

pub use kv_blocks::kv_blocks;
pub use parsers::{
    gateway_config, gguf_file, openai_request, prometheus_text, sse_stream, telemetry,
};
pub use prefix_index::prefix_index;
pub use tokenizer::tokenizer;

/// A target's check.
pub type Check = fn(&[u8]);

/// Every target, by the name of its binary and corpus directory.
pub const TARGETS: &[(&str, Check)] = &[
    ("openai_request", openai_request),
    ("sse_stream", sse_stream),
    ("gateway_config", gateway_config),
    ("gguf_file", gguf_file),
    ("tokenizer", tokenizer),
    ("prefix_index", prefix_index),
    ("kv_blocks", kv_blocks),
    ("telemetry", telemetry),
    ("prometheus_text", prometheus_text),
];
