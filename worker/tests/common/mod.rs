//! Shared by the worker's integration tests.
#![allow(dead_code, clippy::panic)]

use std::path::PathBuf;

/// The default model, fetched by `scripts/fetch-model` (the test command runs it).
pub fn default_model() -> PathBuf {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        path.exists(),
        "{} is missing: run scripts/fetch-model",
        path.display()
    );
    path
}
