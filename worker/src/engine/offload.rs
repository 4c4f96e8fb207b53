//! The engine's side of the offload tiers: cached blocks the pool evicts are copied out of the
//! backend before anything overwrites them, and blocks taken for prefixes a tier holds are
//! written back before the step that reads them.

use super::Engine;
use crate::backend::{Backend, BackendError, BlockCosts};
use crate::kv::DiskTier;
use kvgate_protocol::kv_events::Tier;
use kvgate_protocol::worker_stats::DiskTierStats;
use std::path::Path;

impl<B: Backend> Engine<B> {
    /// Keeps evicted prefix blocks in a host tier of `capacity_bytes`. Prefixes found there
    /// are loaded back while the backend's measured load cost is below recomputing them.
    /// Returns that cost (relative to recomputing), or why the tier cannot run.
    pub fn enable_offload(&mut self, capacity_bytes: usize) -> Result<f64, String> {
        if !self.config.prefix_caching {
            return Err("an offload tier needs prefix caching, which is off".into());
        }
        let costs = self.block_costs()?;
        self.enable_offload_at(capacity_bytes, costs.load_cost());
        Ok(costs.load_cost())
    }

    pub(super) fn block_costs(&mut self) -> Result<BlockCosts, String> {
        if let Some(costs) = self.block_costs {
            return Ok(costs);
        }
        let costs = self.backend.block_costs(self.config.block_size).ok_or(
            "this backend cannot offload K/V (the cpu backend can; the sim backend with a profile that names hardware.host_link_gb_s)",
        )?;
        self.block_costs = Some(costs);
        Ok(costs)
    }

    /// Puts a disk tier of `capacity_bytes` in `dir` below the host tier (which must be on):
    /// blocks the host tier evicts are written there, and prefixes found there are read back
    /// while a read and a load cost less than computing them. Returns that cost, or why the
    /// tier cannot run.
    pub fn enable_disk_tier(&mut self, dir: &Path, capacity_bytes: usize) -> Result<f64, String> {
        if !self.kv.offload_enabled() {
            return Err("a disk tier sits below the host tier: give --kv-offload-mib too".into());
        }
        let costs = self.block_costs()?;
        if !costs.exports_bytes {
            return Err("this backend models K/V without bytes to write to disk (the sim backend; the cpu backend has them)".into());
        }
        let disk = DiskTier::open(dir, capacity_bytes)?;
        let read = disk.time_read(costs.bytes)?;
        let cost = costs.load_cost_after(read.as_secs_f64());
        self.kv.enable_disk_tier(disk, cost < 1.0)?;
        self.stats.offload.disk = Some(DiskTierStats {
            capacity_bytes: capacity_bytes as u64,
            load_cost: cost,
            ..DiskTierStats::default()
        });
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
            match (load.from, &mut self.stats.offload.disk) {
                (Tier::Disk, Some(disk)) => disk.loaded_blocks += 1,
                _ => self.stats.offload.loaded_blocks += 1,
            }
        }
        Ok(())
    }

    /// Evicted blocks out to the tier, before the step writes them (drafts take blocks too).
    pub(super) fn offload_evicted(&mut self) {
        for evicted in self.kv.take_evicted() {
            if let Some(data) = self.backend.export_block(evicted.id) {
                let bytes = self.block_costs.map_or(data.len(), |c| c.bytes);
                self.kv.offload(evicted, data, bytes);
                self.stats.offload.offloaded_blocks += 1;
            }
        }
        let (blocks, bytes) = self.kv.offload_usage();
        self.stats.offload.blocks = blocks as u64;
        self.stats.offload.bytes = bytes as u64;
        if let Some(stats) = &mut self.stats.offload.disk {
            self.kv.with_disk_tier(|disk| {
                stats.blocks = disk.len() as u64;
                stats.bytes = disk.used_bytes() as u64;
                stats.stored_blocks = disk.stored_blocks();
                stats.failed_reads = disk.failed_reads();
            });
        }
    }
}
