//! Precise prefix index (token mode): block hash → the replicas that hold the block and in
//! which tier, fed by the workers' KV events, which name exactly the hashes the gateway computes
//! from the prompt's token ids. A routing decision adds short-lived assumed entries for
//! the chosen replica, covering the time until its stored-block events arrive (and standing,
//! whatever the events say, until they expire: through an eviction they keep the prefix on the
//! replica that computes it again, where ending them at the events spread it); a prompt sent to
//! several replicas in that time is guessed on each (up to [`GUESSES_PER_BLOCK`]). To keep a
//! decision cheap, a guess is recorded at every [`ASSUMED_STRIDE`]-th block and at the
//! prompt's last one, so a guessed run is counted in whole strides (a later prompt that shares
//! 18 blocks of a guessed 20 counts 16).
//!
//! Each replica's events apply in sequence; a gap (or no snapshot yet) makes
//! [`PreciseIndex::apply`] ask for a snapshot, which replaces what the replica held.

use crate::holders::{holder, replica_of, tiers_of, Holder, Holders};
use crate::in_order::InOrder;
use crate::lru::LruSet;
use crate::tiers::{tier_bit, HeldByTier, TierValues, DEVICE, DISK, HOST};
use crate::ReplicaId;
use kvgate_protocol::kv_events::{KvEvent, KvEventBatch, KvSnapshot, Tier};
use kvgate_protocol::telemetry::KvUpdate;
use kvgate_protocol::HashKeyMap;
use std::collections::VecDeque;

/// Blocks between two recorded guesses.
pub const ASSUMED_STRIDE: usize = 4;

/// Replicas guessed to hold one block at most: past this many, a new guess replaces the one
/// due first (the replicas sent a prompt before their events arrive, within reason; a hot
/// prefix on a large fleet counts as held everywhere by the group rule anyway).
pub const GUESSES_PER_BLOCK: usize = 16;

/// Whether block `i` of an `n`-block prompt carries a guess.
fn is_checkpoint(i: usize, n: usize) -> bool {
    i % ASSUMED_STRIDE == ASSUMED_STRIDE - 1 || i + 1 == n
}

#[derive(Debug, Clone, Default)]
struct ReplicaBlocks {
    /// Block hash → tiers it is held in.
    blocks: HashKeyMap<u8>,
    /// How many of them are on the device.
    device: u64,
    /// The last event batch applied; `None` until a snapshot.
    seq: Option<u64>,
    /// Blocks its events removed from the device lately.
    removed: Option<LruSet>,
    /// Of the blocks its events store on the device, the share (a moving average) it had
    /// removed lately: what it computes again for having evicted it.
    recomputed: f64,
}

/// Removed blocks remembered per replica, to tell a block computed again.
const REMOVED_REMEMBERED: usize = 8_192;

/// Stored blocks the recompute share averages over, about.
const RECOMPUTE_WINDOW: f64 = 256.0;

impl ReplicaBlocks {
    fn note_removed(&mut self, hashes: &[u64]) {
        let removed = self
            .removed
            .get_or_insert_with(|| LruSet::new(REMOVED_REMEMBERED));
        for &h in hashes {
            removed.insert(h);
        }
    }

    fn note_stored(&mut self, hash: u64, reloaded: bool) {
        let again = !reloaded && self.removed.as_ref().is_some_and(|r| r.contains(hash));
        self.recomputed += (f64::from(u8::from(again)) - self.recomputed) / RECOMPUTE_WINDOW;
    }
}

#[derive(Debug, Clone, Default)]
pub struct PreciseIndex {
    /// Block hash → (replica, tiers).
    holders: HashKeyMap<Holders>,
    per_replica: Vec<ReplicaBlocks>,
    /// Checkpoint block hash → the guesses of the routing decisions that sent it, until they
    /// expire; one per replica.
    assumed: HashKeyMap<Vec<Guess>>,
    /// Guesses in expiry order (expiry, hash), for purging.
    expiries: VecDeque<(u64, u64)>,
    /// Per replica slot: its lower tiers' worth, as its engine measured.
    tier_values: Vec<TierValues>,
}

/// A routing decision's guess that a replica holds a block.
#[derive(Debug, Clone, Copy)]
struct Guess {
    replica: ReplicaId,
    expires_ms: u64,
    /// The replica's events removed the block from its device since the guess was made.
    evicted: bool,
}

/// Which guesses count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Guesses {
    All,
    /// Only the latest decision's.
    Latest,
    /// Only those no later event contradicts.
    Unevicted,
}

/// What applying a report's KV update did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Applied {
    pub batches: usize,
    /// Events were missing (or there was no snapshot yet): the replica's agent should send one.
    pub needs_snapshot: bool,
}

impl PreciseIndex {
    /// (replica, block) entries held from events.
    pub fn len(&self) -> usize {
        self.per_replica.iter().map(|r| r.blocks.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Sets what blocks in `replica`'s lower tiers are worth.
    pub fn set_tier_values(&mut self, replica: ReplicaId, values: TierValues) {
        let slot = replica.0 as usize;
        if self.tier_values.len() <= slot {
            if values == TierValues::default() {
                return;
            }
            self.tier_values.resize(slot + 1, TierValues::default());
        }
        self.tier_values[slot] = values.sanitized();
    }

    fn tier_values(&self, replica: ReplicaId) -> TierValues {
        self.tier_values
            .get(replica.0 as usize)
            .copied()
            .unwrap_or_default()
    }

    fn replica_mut(&mut self, replica: ReplicaId) -> &mut ReplicaBlocks {
        let slot = replica.0 as usize;
        if self.per_replica.len() <= slot {
            self.per_replica
                .resize_with(slot + 1, ReplicaBlocks::default);
        }
        &mut self.per_replica[slot]
    }

    /// Applies a replica's KV update: its snapshot replaces what it held, then batches in
    /// sequence (already-seen ones are skipped; a gap stops the update and asks for a snapshot).
    pub fn apply(&mut self, replica: ReplicaId, update: &KvUpdate) -> Applied {
        if let Some(snapshot) = &update.snapshot {
            self.load_snapshot(replica, snapshot);
        }
        let mut applied = Applied::default();
        for batch in &update.batches {
            match self.replica_mut(replica).seq {
                Some(seq) if batch.seq <= seq => continue,
                Some(seq) if batch.seq == seq + 1 => {}
                _ => {
                    applied.needs_snapshot = true;
                    return applied;
                }
            }
            self.apply_batch(replica, batch);
            applied.batches += 1;
        }
        applied.needs_snapshot = self.replica_mut(replica).seq.is_none();
        applied
    }

    fn load_snapshot(&mut self, replica: ReplicaId, snapshot: &KvSnapshot) {
        self.clear_blocks(replica);
        for &h in &snapshot.hashes {
            self.add(replica, h, DEVICE);
        }
        for &h in &snapshot.host_hashes {
            self.add(replica, h, HOST);
        }
        for &h in &snapshot.disk_hashes {
            self.add(replica, h, DISK);
        }
        self.replica_mut(replica).seq = Some(snapshot.seq);
    }

    fn apply_batch(&mut self, replica: ReplicaId, batch: &KvEventBatch) {
        for event in &batch.events {
            match event {
                KvEvent::Stored { hashes, tier, .. } => {
                    for &h in hashes {
                        let held = self.replica_mut(replica).blocks.get(&h).copied();
                        self.add(replica, h, tier_bit(*tier));
                        if *tier == Tier::Device {
                            // Loaded back from a lower tier is not computed again.
                            let reloaded = held.is_some_and(|t| t & (HOST | DISK) != 0);
                            self.replica_mut(replica).note_stored(h, reloaded);
                        }
                    }
                }
                KvEvent::Removed { hashes, tier } => {
                    for &h in hashes {
                        self.remove(replica, h, tier_bit(*tier));
                    }
                    if *tier == Tier::Device {
                        self.replica_mut(replica).note_removed(hashes);
                        self.note_evicted_guesses(replica, hashes);
                    }
                }
                KvEvent::AllCleared => {
                    let seq = self.replica_mut(replica).seq;
                    self.clear_blocks(replica);
                    self.replica_mut(replica).seq = seq;
                }
            }
        }
        self.replica_mut(replica).seq = Some(batch.seq);
    }

    fn note_evicted_guesses(&mut self, replica: ReplicaId, hashes: &[u64]) {
        for h in hashes {
            if let Some(guesses) = self.assumed.get_mut(h) {
                for g in guesses.iter_mut().filter(|g| g.replica == replica) {
                    g.evicted = true;
                }
            }
        }
    }

    fn add(&mut self, replica: ReplicaId, hash: u64, bit: u8) {
        let held = self.replica_mut(replica);
        let tiers = held.blocks.entry(hash).or_insert(0);
        let was = *tiers;
        *tiers |= bit;
        let tiers = *tiers;
        held.device += u64::from(tiers & DEVICE != 0 && was & DEVICE == 0);
        self.holders
            .entry(hash)
            .and_modify(|h| h.set(replica, tiers))
            .or_insert(Holders::One(holder(replica, tiers)));
    }

    fn remove(&mut self, replica: ReplicaId, hash: u64, bit: u8) {
        let held = self.replica_mut(replica);
        let Some(tiers) = held.blocks.get_mut(&hash) else {
            return;
        };
        let was = *tiers;
        *tiers &= !bit;
        let tiers = *tiers;
        if tiers == 0 {
            held.blocks.remove(&hash);
        }
        held.device -= u64::from(was & DEVICE != 0 && tiers & DEVICE == 0);
        self.set_holder(hash, replica, tiers);
    }

    fn set_holder(&mut self, hash: u64, replica: ReplicaId, tiers: u8) {
        if let Some(holders) = self.holders.get_mut(&hash) {
            holders.set(replica, tiers);
            if holders.is_empty() {
                self.holders.remove(&hash);
            }
        }
    }

    /// Of the blocks `replica`'s events stored on its device lately, the share its events had
    /// removed shortly before (0 with none): a cache recomputing what it evicted.
    pub fn recompute_share(&self, replica: ReplicaId) -> f64 {
        self.per_replica
            .get(replica.0 as usize)
            .map_or(0.0, |r| r.recomputed)
    }

    /// The blocks `replica`'s KV events show on its device (`None` before its first
    /// snapshot).
    pub fn device_blocks(&self, replica: ReplicaId) -> Option<u64> {
        let held = self.per_replica.get(replica.0 as usize)?;
        held.seq.map(|_| held.device)
    }

    /// Forgets everything `replica` held, and its event sequence (it restarted or left): its
    /// next update must start with a snapshot.
    pub fn clear_replica(&mut self, replica: ReplicaId) {
        self.clear_blocks(replica);
        self.assumed.retain(|_, guesses| {
            guesses.retain(|g| g.replica != replica);
            !guesses.is_empty()
        });
    }

    /// Forgets the blocks `replica`'s events reported, and its event sequence, but not the
    /// guesses: a snapshot or a cleared cache says nothing of the prompts sent to it that it
    /// has not computed yet.
    fn clear_blocks(&mut self, replica: ReplicaId) {
        let old = std::mem::take(self.replica_mut(replica));
        for &hash in old.blocks.keys() {
            self.set_holder(hash, replica, 0);
        }
    }

    /// Notes that `replica` was sent a prompt with these blocks, of which it holds the first
    /// `held` already: until `expires_ms`, the rest count as held there.
    pub fn assume(
        &mut self,
        replica: ReplicaId,
        hashes: &[u64],
        held: usize,
        now_ms: u64,
        expires_ms: u64,
    ) {
        self.purge_expired(now_ms);
        let n = hashes.len();
        for (i, &hash) in hashes.iter().enumerate().skip(held) {
            if is_checkpoint(i, n) {
                let guesses = self.assumed.entry(hash).or_default();
                let guess = Guess {
                    replica,
                    expires_ms,
                    evicted: false,
                };
                match guesses.iter().position(|g| g.replica == replica) {
                    Some(at) => guesses[at] = guess,
                    None if guesses.len() < GUESSES_PER_BLOCK => guesses.push(guess),
                    None => {
                        if let Some(due) = guesses.iter_mut().min_by_key(|g| g.expires_ms) {
                            *due = guess;
                        }
                    }
                }
                self.expiries.push_back((expires_ms, hash));
            }
        }
    }

    /// Guesses recorded and not yet purged, one per replica and block.
    pub fn assumed_len(&self) -> usize {
        self.assumed.values().map(Vec::len).sum()
    }

    fn purge_expired(&mut self, now_ms: u64) {
        while let Some(&(expires, hash)) = self.expiries.front() {
            if expires > now_ms {
                break;
            }
            self.expiries.pop_front();
            // A later decision may have renewed a guess: drop only those due.
            if let Some(guesses) = self.assumed.get_mut(&hash) {
                guesses.retain(|g| g.expires_ms > now_ms);
                if guesses.is_empty() {
                    self.assumed.remove(&hash);
                }
            }
        }
    }

    /// For each replica holding a leading run of `hashes` (from events, or assumed until
    /// `now_ms`), the run's worth in blocks: 1 per device block, and per host block what
    /// loading it back saves on that replica (its engine's measure, else 0.5). Written
    /// into `matched`, indexed by replica slot (which must be long enough).
    pub fn overlaps(&self, hashes: &[u64], now_ms: u64, matched: &mut [f64]) {
        let runs = self.runs_from_events(hashes);
        self.overlaps_from(&runs, hashes, now_ms, Guesses::All, matched);
    }

    /// As [`PreciseIndex::overlaps`], and into `latest` the same with only the latest
    /// decision's guess of each block.
    pub fn overlaps_and_latest(
        &self,
        hashes: &[u64],
        now_ms: u64,
        matched: &mut [f64],
        latest: &mut [f64],
    ) {
        let runs = self.runs_from_events(hashes);
        self.overlaps_from(&runs, hashes, now_ms, Guesses::All, matched);
        self.overlaps_from(&runs, hashes, now_ms, Guesses::Latest, latest);
    }

    /// As [`PreciseIndex::overlaps`], without the guesses that the replica's events removed
    /// a block of since they were made.
    pub fn overlaps_unevicted(&self, hashes: &[u64], now_ms: u64, matched: &mut [f64]) {
        let runs = self.runs_from_events(hashes);
        self.overlaps_from(&runs, hashes, now_ms, Guesses::Unevicted, matched);
    }

    fn overlaps_from(
        &self,
        runs: &[Run],
        hashes: &[u64],
        now_ms: u64,
        which: Guesses,
        matched: &mut [f64],
    ) {
        for run in runs {
            if let Some(m) = matched.get_mut(run.replica.0 as usize) {
                *m = run.value;
            }
        }
        self.extend_by_guesses(hashes, now_ms, which, runs, matched);
    }

    /// The leading run of `hashes` that `replica`'s KV events say it holds, split by the tier
    /// each block is in (guesses not counted): what the admin API's explain shows.
    pub fn held_by_tier(&self, hashes: &[u64], replica: ReplicaId) -> HeldByTier {
        let mut held = HeldByTier::default();
        for hash in hashes {
            let tiers = self.holders.get(hash).map_or(0, |h| h.tiers(replica));
            if !held.add(tiers, 1) {
                break;
            }
        }
        held
    }

    /// Walks the blocks while some replica still holds the whole run, each block's holders
    /// merged with the replicas whose run goes on (both in replica order) where they differ
    /// from the block before's: a long prompt the whole fleet holds costs a lookup a block
    /// and a merge a change of holders. The runs come in replica order.
    fn runs_from_events(&self, hashes: &[u64]) -> Vec<Run> {
        let Some(first) = hashes.first().and_then(|h| self.holders.get(h)) else {
            return Vec::new();
        };
        let replicas: Vec<ReplicaId> = first.replicas().collect();
        let mut held = vec![HeldByTier::default(); replicas.len()];
        // The runs going on, each with the tiers of its last block. A long prompt's blocks
        // mostly have the holders of the block before: those repeats are counted at once.
        let mut going: Vec<(usize, u8)> = (0..replicas.len()).map(|at| (at, 0)).collect();
        let mut last: &[Holder] = &[];
        let mut repeats = 0;
        for hash in hashes {
            let Some(holders) = self.holders.get(hash) else {
                break;
            };
            if holders.entries() == last {
                repeats += 1;
                continue;
            }
            for &(at, tiers) in &going {
                held[at].add(tiers, repeats);
            }
            repeats = 0;
            last = holders.entries();
            let mut holding = InOrder::new(last, |&h| replica_of(h));
            going.retain_mut(|(at, tiers)| {
                let replica = replicas[*at];
                *tiers = holding.find(replica).map_or(0, |&h| tiers_of(h));
                self.tier_values(replica).block_value(*tiers) > 0.0 && held[*at].add(*tiers, 1)
            });
            if going.is_empty() {
                break;
            }
        }
        for &(at, tiers) in &going {
            held[at].add(tiers, repeats);
        }
        replicas
            .into_iter()
            .zip(held)
            .map(|(replica, held)| Run {
                replica,
                value: self.tier_values(replica).run_value(held),
                blocks: held.blocks(),
            })
            .collect()
    }

    /// Extends runs through the checkpoints guessed for their replica, past the blocks known
    /// from events (or from the start); a guessed block counts as on the device. The replicas
    /// still in the running are merged with each checkpoint's guesses, both in replica order.
    fn extend_by_guesses(
        &self,
        hashes: &[u64],
        now_ms: u64,
        which: Guesses,
        runs: &[Run],
        matched: &mut [f64],
    ) {
        let n = hashes.len();
        let mut guessed: Vec<ReplicaId> = Vec::with_capacity(GUESSES_PER_BLOCK);
        let mut alive: Option<Vec<Run>> = None;
        for (i, hash) in hashes
            .iter()
            .enumerate()
            .filter(|&(i, _)| is_checkpoint(i, n))
        {
            self.live_guesses(hash, now_ms, which, &mut guessed);
            let alive = alive.get_or_insert_with(|| {
                let mut first = runs.to_vec();
                let known = |r: &ReplicaId| runs.binary_search_by_key(r, |x| x.replica).is_ok();
                first.extend(guessed.iter().filter(|r| !known(r)).map(|&replica| Run {
                    replica,
                    value: 0.0,
                    blocks: 0,
                }));
                first.sort_by_key(|r| r.replica);
                first
            });
            let mut guesses = InOrder::new(&guessed, |&r| r);
            alive.retain(|run| {
                let is_guessed = guesses.find(run.replica).is_some();
                if is_guessed {
                    if let Some(m) = matched.get_mut(run.replica.0 as usize) {
                        let past_known = i + 1 - run.blocks.min(i + 1);
                        *m = m.max(run.value + past_known as f64);
                    }
                }
                is_guessed || run.blocks > i
            });
            if alive.is_empty() {
                return;
            }
        }
    }

    /// Into `guessed`, in replica order: the replicas guessed to hold `hash` now, of those
    /// `which` counts.
    fn live_guesses(&self, hash: &u64, now_ms: u64, which: Guesses, guessed: &mut Vec<ReplicaId>) {
        guessed.clear();
        let guesses = self.assumed.get(hash).map_or(&[][..], Vec::as_slice);
        let newest = guesses
            .iter()
            .max_by_key(|g| g.expires_ms)
            .map(|g| g.replica);
        guessed.extend(
            guesses
                .iter()
                .filter(|g| g.expires_ms > now_ms)
                .filter(|g| match which {
                    Guesses::All => true,
                    Guesses::Latest => newest == Some(g.replica),
                    Guesses::Unevicted => !g.evicted,
                })
                .map(|g| g.replica),
        );
        guessed.sort_unstable();
    }
}

/// A replica's leading run of a prompt's blocks, from events.
#[derive(Clone, Copy)]
struct Run {
    replica: ReplicaId,
    /// Worth in blocks (host blocks count half).
    value: f64,
    blocks: usize,
}

#[cfg(test)]
mod tests;
