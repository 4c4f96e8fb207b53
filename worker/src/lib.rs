//! The kvgate worker: an inference engine (paged KV cache with prefix caching, continuous
//! batching, chunked prefill) behind an OpenAI-compatible HTTP server.

pub mod backend;
pub mod engine;
pub mod kv;
pub mod model;
pub mod request;
pub mod sample;
pub mod sched;
pub mod server;
pub mod spec;
pub mod transfer;

pub use engine::{Engine, EngineConfig, EngineError, NewRequest, StepOutput, TokenOutput};
pub use request::{FinishReason, RequestId, SamplingParams};
