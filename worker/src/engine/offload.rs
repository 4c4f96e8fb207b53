//! The engine's side of the offload tier: cached blocks the pool evicts are copied out of the
//! backend before anything overwrites them, and blocks taken for prefixes the tier holds are
//! written back before the step that reads them.

use super::Engine;
use crate::backend::{Backend, BackendError};

impl<B: Backend> Engine<B> {
    /// Keeps evicted prefix blocks in a host tier of `capacity_bytes`. Prefixes found there
    /// are loaded back while the backend's measured load cost is below recomputing them.
    /// Returns that cost (relative to recomputing), or why the tier cannot run.
    pub fn enable_offload(&mut self, capacity_bytes: usize) -> Result<f64, String> {
        if !self.config.prefix_caching {
            return Err("an offload tier needs prefix caching, which is off".into());
        }
        let cost = self.backend.block_load_cost().ok_or(
            "this backend holds no K/V to offload (the cpu backend does; the sim backend does not)",
        )?;
        self.enable_offload_at(capacity_bytes, cost);
        Ok(cost)
    }

    /// As [`Engine::enable_offload`], with the load cost given rather than measured.
    pub fn enable_offload_at(&mut self, capacity_bytes: usize, load_cost: f64) {
        self.kv.enable_offload(capacity_bytes);
        self.kv.set_loads_pay(load_cost < 1.0);
        self.stats.offload.capacity_bytes = capacity_bytes as u64;
        self.stats.offload.load_cost = Some(load_cost);
    }

    /// After scheduling: evicted blocks out to the tier, then the planned loads in (an
    /// evicted block may be the one a load fills).
    pub(super) fn move_offloaded_blocks(&mut self) -> Result<(), BackendError> {
        if !self.kv.offload_enabled() {
            return Ok(());
        }
        self.offload_evicted();
        for load in self.kv.take_loads() {
            self.backend.import_block(load.id, &load.data)?;
            self.stats.offload.loaded_blocks += 1;
        }
        Ok(())
    }

    /// Evicted blocks out to the tier, before the step writes them (drafts take blocks too).
    pub(super) fn offload_evicted(&mut self) {
        for evicted in self.kv.take_evicted() {
            if let Some(data) = self.backend.export_block(evicted.id) {
                self.kv.offload(evicted, data);
                self.stats.offload.offloaded_blocks += 1;
            }
        }
        let (blocks, bytes) = self.kv.offload_usage();
        self.stats.offload.blocks = blocks as u64;
        self.stats.offload.bytes = bytes as u64;
    }
}
