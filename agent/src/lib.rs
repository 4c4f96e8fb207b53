//! `kvgate agent`: one per GPU. It supervises one worker process (or attaches to a running
//! engine), reads the engine's telemetry through an [`adapter::EngineAdapter`], and pushes a
//! [`TelemetryReport`](kvgate_protocol::telemetry::TelemetryReport) to every gateway.

pub mod adapter;
mod gpu;
pub mod http;
mod kv_relay;
pub mod lineage;
pub mod push;
pub mod supervisor;

pub use push::{run, shutdown_signal, AgentConfig};
