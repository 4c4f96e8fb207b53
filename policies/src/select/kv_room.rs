//! Guesses that an eviction contradicted. A decision's guess that a replica holds a prompt it
//! was sent stands through an eviction, so that a group that recurs stays on the replica that
//! computes it again. For a group that does not recur there is nothing to stay for: the
//! replica computes the evicted blocks again as any other would, and counted as held they draw
//! requests to the busiest replicas (where the cache turns over fastest). Such a guess still
//! counts where no replica has room for the prompt's rest (the request waits anywhere).

use super::Policy;
use crate::{FleetView, RequestFeatures};

impl Policy {
    /// In token mode, for a group that does not recur, where some healthy replica has room
    /// for the part of the prompt it lacks: counts only the guesses no later eviction
    /// contradicts (`matched`, by slot, in blocks of the prompt's `blocks`).
    pub(super) fn drop_evicted_guesses(
        &self,
        features: &RequestFeatures,
        fleet: FleetView<'_>,
        blocks: usize,
        matched: &mut [f64],
    ) {
        if features.block_hashes.is_empty() {
            return;
        }
        // The replicas that count some of it held, and whether one could take its rest at
        // once (no allocation unless one holds some).
        let (mut holding, mut roomy, mut healthy) = (Vec::new(), false, 0);
        for r in fleet.replicas.iter().filter(|r| r.healthy) {
            healthy += 1;
            let held = matched.get(r.id.0 as usize).copied().unwrap_or(0.0);
            let rest = features.prompt_tokens as f64 * (1.0 - held / blocks.max(1) as f64);
            roomy |= r.kv_room_tokens().is_none_or(|room| room as f64 >= rest);
            if held > 0.0 {
                holding.push(r.id.0 as usize);
            }
        }
        if holding.is_empty()
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
        for slot in holding {
            matched[slot] = unevicted[slot].min(matched[slot]);
        }
    }
}
