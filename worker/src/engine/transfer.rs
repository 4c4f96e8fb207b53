//! The engine's side of prefill/decode disaggregation: a prompt's blocks read out for a
//! decode worker, and blocks a prefill worker computed taken into the host tier, from where
//! a request's prefix lookup loads them like any offloaded block.

use super::Engine;
use crate::backend::Backend;
use crate::transfer::TransferBlock;
use kvgate_protocol::extend_block_hashes;

impl<B: Backend> Engine<B> {
    /// The hashes of `prompt`'s blocks that a prefix hit may cover (all full blocks but one
    /// holding the last token, whose logits are needed).
    pub fn prompt_chain(&self, prompt: &[u32]) -> Vec<u64> {
        let block_size = self.config.block_size;
        let mut chain = Vec::new();
        extend_block_hashes(self.kv.seed(), prompt, block_size, &mut chain);
        chain.truncate(prompt.len().saturating_sub(1) / block_size);
        chain
    }

    /// Whether each of `chain`'s blocks is held here (the KV pool or the host tier).
    pub fn held_blocks(&self, chain: &[u64]) -> Vec<bool> {
        chain.iter().map(|&h| self.kv.holds(h)).collect()
    }

    /// The K/V of `chain`'s leading blocks that this engine holds (the pool, else the
    /// offload tiers), up to the first it does not.
    pub fn export_prefix(&mut self, chain: &[u64]) -> Vec<TransferBlock> {
        let mut blocks = Vec::new();
        for (i, &hash) in chain.iter().enumerate() {
            let data = match self.kv.cached_block(hash) {
                Some(id) => self.backend.export_block(id).map(Into::into),
                None => self.kv.fetch_offloaded(hash),
            };
            let Some(data) = data else { break };
            let parent = i.checked_sub(1).map(|p| chain[p]);
            blocks.push(TransferBlock { hash, parent, data });
        }
        blocks
    }

    /// Takes blocks another worker computed into the host tier; returns how many. A block
    /// whose size is not this backend's is left out (another model's, or another build's).
    pub fn import_blocks(&mut self, blocks: Vec<TransferBlock>) -> Result<usize, String> {
        if !self.kv.offload_enabled() {
            return Err("taking blocks in needs the host tier (--kv-offload-mib)".into());
        }
        let costs = self.block_costs()?;
        let size = if costs.exports_bytes { costs.bytes } else { 0 };
        let mut taken = 0;
        for block in blocks.into_iter().filter(|b| b.data.len() == size) {
            self.kv
                .stage(block.hash, block.parent, block.data, costs.bytes);
            taken += 1;
        }
        self.stats.offload.imported_blocks += taken as u64;
        Ok(taken)
    }
}
