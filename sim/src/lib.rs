//! `kvgate sim`: a fleet in virtual time. Each replica is the worker's real `Engine` on the sim
//! backend (so scheduling, chunked prefill, preemption, prefix caching and eviction are the
//! real code), each gateway the real `FleetState` from `policies/`; agents' reports and KV
//! events reach the gateways at a set interval and delay. Nothing sleeps: a step's modelled
//! duration moves the clock.

mod fleet;
mod peers;
mod routers;
mod tokens;

pub use fleet::{simulate, Outcome, SimConfig};
pub use routers::Router;
