//! `kvgate sim`: a fleet in virtual time. Each replica is the worker's real `Engine` on the sim
//! backend (so scheduling, chunked prefill, preemption, prefix caching and eviction are the
//! real code), each gateway the real `FleetState` from `policies/`; agents' reports and KV
//! events reach the gateways at a set interval and delay. Nothing sleeps: a step's modelled
//! duration moves the clock.

mod config;
mod exchange;
mod fleet;
mod floor;
mod gateway;
mod lookahead;
mod oracle;
mod peers;
mod replica;
mod routers;
mod timeline;
mod tokens;
mod verdict;

pub use config::SimConfig;
pub use fleet::{simulate, simulate_with_progress, Outcome, Progress};
pub use floor::{below_floor, floor_records};
pub use oracle::{search as search_oracle, Figure, Searched, Starts, FIGURES};
pub use routers::{Policy, Router, Routes, Turn, NAMES};
pub use timeline::{ReplicaSample, Timeline};
pub use verdict::oracle_bound;
