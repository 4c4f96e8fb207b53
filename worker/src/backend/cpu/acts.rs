//! A step's activations quantised to Q8 (ggml's q8_0/q8_1 blocks, one row per token), and,
//! for the AVX-512 kernels, the same rows interleaved eight tokens at a time so that one
//! 512-bit load brings a block of two tokens and its scales.

use super::quant::{Q8Row, QK};
use super::team::Team;

/// Tokens per interleaved group.
pub const GROUP: usize = 8;

/// Eight tokens' quantised rows, interleaved by block.
#[derive(Debug, Default)]
pub struct Group8 {
    /// Per block: the codes of tokens (0,1), (2,3), (4,5), (6,7), each pair 64 bytes.
    pub q: Vec<i8>,
    /// Per block and pair: the two tokens' scales, each repeated over 8 lanes (16 floats).
    pub d: Vec<f32>,
    /// Per block: the eight tokens' block sums `s` (for Q4_1's offset term).
    pub s: Vec<f32>,
}

impl Group8 {
    pub fn blocks(&self) -> usize {
        self.s.len() / GROUP
    }

    fn fill(&mut self, rows: &[Q8Row]) {
        let blocks = rows[0].d.len();
        self.q.resize(blocks * GROUP * QK, 0);
        self.d.resize(blocks * GROUP * 8, 0.0);
        self.s.resize(blocks * GROUP, 0.0);
        for b in 0..blocks {
            for (t, row) in rows.iter().enumerate() {
                let at = (b * GROUP + t) * QK;
                self.q[at..at + QK].copy_from_slice(&row.q[b * QK..(b + 1) * QK]);
                let at = (b * GROUP + t) * 8;
                self.d[at..at + 8].fill(row.d[b]);
                self.s[b * GROUP + t] = row.s[b];
            }
        }
    }
}

/// The quantised activations of one product's input.
#[derive(Debug, Default)]
pub struct Activations {
    pub rows: Vec<Q8Row>,
    /// Whole groups of eight rows, interleaved (only when `pack` asked for them).
    pub groups: Vec<Group8>,
    /// How many of `groups` are current.
    grouped: usize,
}

impl Activations {
    /// Room for `tokens` rows.
    pub fn reserve(&mut self, tokens: usize) {
        if self.rows.len() < tokens {
            self.rows.resize_with(tokens, Q8Row::default);
        }
    }

    /// Interleaves the first `tokens` rows eight at a time (all but the last `tokens % 8`),
    /// a group per task on `team`, or forgets earlier groups when `pack` is false.
    pub fn pack(&mut self, tokens: usize, pack: bool, team: &Team) {
        self.grouped = if pack { tokens / GROUP } else { 0 };
        if self.groups.len() < self.grouped {
            self.groups.resize_with(self.grouped, Group8::default);
        }
        let rows = &self.rows;
        team.for_each_chunk(&mut self.groups[..self.grouped], 1, |g, group| {
            group[0].fill(&rows[g * GROUP..(g + 1) * GROUP]);
        });
    }

    /// The current interleaved groups (covering tokens `0..8 * groups().len()`).
    pub fn groups(&self) -> &[Group8] {
        &self.groups[..self.grouped]
    }
}
