//! Where a block lives, as the precise index stores it (a bit per tier), and what a block in
//! each tier is worth to a request.

use kvgate_protocol::kv_events::Tier;

pub(crate) const DEVICE: u8 = 1;
pub(crate) const HOST: u8 = 2;
pub(crate) const DISK: u8 = 4;

pub(crate) fn tier_bit(tier: Tier) -> u8 {
    match tier {
        Tier::Device => DEVICE,
        Tier::Host => HOST,
        Tier::Disk => DISK,
    }
}

/// A host-tier block's worth against a device block's when its engine does not say.
pub const DEFAULT_HOST_VALUE: f64 = 0.5;
/// A disk-tier block's worth when its engine does not say.
pub const DEFAULT_DISK_VALUE: f64 = 0.25;

/// What a replica's lower-tier blocks are worth against a device block: the share of
/// computing one that loading it back saves, as its engine measured (`None`: the default).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TierValues {
    pub host: Option<f64>,
    pub disk: Option<f64>,
}

impl TierValues {
    /// Each value in [0, 1]; one that is not a number is the default.
    pub(crate) fn sanitized(self) -> TierValues {
        let clean = |v: Option<f64>| v.filter(|v| v.is_finite()).map(|v| v.clamp(0.0, 1.0));
        TierValues {
            host: clean(self.host),
            disk: clean(self.disk),
        }
    }

    /// What a run of blocks is worth: each at [`TierValues::block_value`].
    pub(crate) fn run_value(self, held: HeldByTier) -> f64 {
        held.device as f64
            + held.host as f64 * self.block_value(HOST)
            + held.disk as f64 * self.block_value(DISK)
    }

    /// How much a held block is worth to a request: a device block is reused as it is, a
    /// lower-tier block must first be copied back, which saves part of computing it.
    pub(crate) fn block_value(self, tiers: u8) -> f64 {
        if tiers & DEVICE != 0 {
            1.0
        } else if tiers & HOST != 0 {
            self.host.unwrap_or(DEFAULT_HOST_VALUE)
        } else if tiers & DISK != 0 {
            self.disk.unwrap_or(DEFAULT_DISK_VALUE)
        } else {
            0.0
        }
    }
}

/// A replica's leading run of a prompt's blocks, by the tier each is in.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct HeldByTier {
    pub device: usize,
    /// Blocks only in its host tier: loaded back before the prompt's step.
    pub host: usize,
    /// Blocks only in its disk tier.
    pub disk: usize,
}

impl HeldByTier {
    /// Counts `n` more blocks in the fastest tier of `tiers`; false (nothing counted) where
    /// `tiers` names none.
    pub(crate) fn add(&mut self, tiers: u8, n: usize) -> bool {
        let count = if tiers & DEVICE != 0 {
            &mut self.device
        } else if tiers & HOST != 0 {
            &mut self.host
        } else if tiers & DISK != 0 {
            &mut self.disk
        } else {
            return false;
        };
        *count += n;
        true
    }

    pub(crate) fn blocks(&self) -> usize {
        self.device + self.host + self.disk
    }
}
