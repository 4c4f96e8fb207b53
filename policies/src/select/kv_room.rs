//! Replicas without KV room for a prompt. A decision's guess that a replica holds a prompt it
//! was sent stands through an eviction, so that a group stays on the replica that computes it
//! again. Where that replica has no room left for the prompt's rest, though, the request
//! waits there for running requests to end, then computes again what was evicted: counted as
//! held, such a guess draws requests to the fullest replicas. It still counts where no replica
//! has room (the request waits anywhere), and for a group that recurs, whose copy elsewhere
//! would evict others' that are used again.

use super::Policy;
use crate::{FleetView, ReplicaView, RequestFeatures};

impl Policy {
    /// In token mode, for a group that does not recur, where some healthy replica has room
    /// for the part of the prompt it lacks: on each replica without that room, counts only
    /// the guesses no later eviction contradicts (`matched`, by slot, in blocks of the prompt's
    /// `blocks`).
    pub(super) fn drop_evicted_guesses_where_no_room(
        &self,
        features: &RequestFeatures,
        fleet: FleetView<'_>,
        blocks: usize,
        matched: &mut [f64],
    ) {
        if features.block_hashes.is_empty() {
            return;
        }
        let lacks_room = |r: &ReplicaView, held: f64| {
            let rest = features.prompt_tokens as f64 * (1.0 - held / blocks.max(1) as f64);
            r.kv_room_tokens().is_some_and(|room| (room as f64) < rest)
        };
        // The replicas that count some of it held but lack room for the rest, and whether
        // another could take it at once (no allocation unless one lacks room).
        let (mut short, mut roomy, mut healthy) = (Vec::new(), false, 0);
        for r in fleet.replicas.iter().filter(|r| r.healthy) {
            healthy += 1;
            let held = matched.get(r.id.0 as usize).copied().unwrap_or(0.0);
            if !lacks_room(r, held) {
                roomy = true;
            } else if held > 0.0 {
                short.push(r.id.0 as usize);
            }
        }
        if short.is_empty()
            || !roomy
            || self
                .group(features)
                .is_some_and(|(g, _)| self.group_recurs(g, healthy, features.now_ms))
        {
            return;
        }
        let mut unevicted = vec![0.0; matched.len()];
        self.precise
            .overlaps_unevicted(&features.block_hashes, features.now_ms, &mut unevicted);
        for slot in short {
            matched[slot] = unevicted[slot].min(matched[slot]);
        }
    }
}
