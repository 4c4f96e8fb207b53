//! Pure routing decisions: request features and a fleet view in, a ranked list of replicas with
//! a per-signal breakdown out. No I/O, no clocks (the caller passes its time in the features),
//! no async: the gateway and the fleet simulator call the same code.

pub mod config;
mod fleet;
mod fleet_state;
mod holders;
mod in_order;
mod live_histories;
mod load_cap;
mod lru;
mod peer_backlog;
mod precise_index;
mod prefill;
mod prefill_queue;
mod prefix_index;
mod replica_state;
mod ring;
mod select;
mod sessions;
mod signal;
mod step_clock;
mod stream_time;
mod tiers;
mod traffic;

pub use config::{PolicyConfig, Weights};
pub use fleet::{FleetView, ReplicaId, ReplicaView, RequestFeatures};
pub use fleet_state::{
    Ask, Ejection, FailureOutcome, FleetState, NoRoute, ReportOutcome, RequestId,
};
pub use peer_backlog::{LAPSE_MS as PEER_BACKLOG_LAPSE_MS, MAX_PEERS};
pub use precise_index::{Applied, PreciseIndex};
pub use prefix_index::ApproxPrefixIndex;
pub use replica_state::{AgentState, Freshness, ReplicaSpec, ReplicaState, ReportAges};
pub use ring::HashRing;
pub use select::{Candidate, Decision, Policy};
pub use signal::{BySignal, Signal};
pub use step_clock::StepClock;
pub use tiers::{HeldByTier, TierValues};
