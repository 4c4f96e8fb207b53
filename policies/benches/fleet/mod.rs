//! The benchmark fleet: `replicas` replicas, 1M prefix chunks indexed across them (text
//! mode), or 1M token blocks known from KV events (token mode).
#![allow(dead_code)]

use kvgate_policies::{
    FleetState, Policy, PolicyConfig, ReplicaId, ReplicaSpec, ReplicaView, RequestFeatures,
};
use kvgate_protocol::kv_events::{KvSnapshot, KV_EVENTS_VERSION};
use kvgate_protocol::telemetry::KvUpdate;
use kvgate_protocol::{block_hashes, text_chunk_hashes, HashSeed};

pub const INDEXED_CHUNKS: usize = 1_000_000;
pub const CHUNKS_PER_PROMPT: usize = 16;

pub fn prompt(i: usize) -> RequestFeatures {
    let text = format!("{i:>8}").repeat(CHUNKS_PER_PROMPT * 256 / 8);
    let chunks = text_chunk_hashes(HashSeed::new("bench", None, ""), text.as_bytes(), 256);
    RequestFeatures {
        ring_key: chunks[0],
        prompt_tokens: text.len() as u64 / 4,
        prefix_chunks: chunks,
        ..RequestFeatures::default()
    }
}

/// A 64 KB prompt: 256 chunks.
pub fn long_prompt() -> RequestFeatures {
    let text = "a long system prompt, ".repeat(64 << 10 >> 4);
    let text = &text.as_bytes()[..64 << 10];
    let chunks = text_chunk_hashes(HashSeed::new("bench", None, ""), text, 256);
    RequestFeatures {
        ring_key: chunks[0],
        prompt_tokens: text.len() as u64 / 4,
        prefix_chunks: chunks,
        ..RequestFeatures::default()
    }
}

/// Token mode: a 4,096-token prompt is 256 blocks of 16 tokens.
pub const INDEXED_BLOCKS: usize = 1_000_000;
pub const BLOCKS_PER_PROMPT: usize = 256;

pub fn token_prompt(i: usize) -> RequestFeatures {
    // The first token tells prompts apart; the hash chain carries it into every block.
    let tokens: Vec<u32> = std::iter::once(i as u32)
        .chain((1..BLOCKS_PER_PROMPT * 16).map(|k| (k % 49_152) as u32))
        .collect();
    let hashes = block_hashes(HashSeed::new("bench", None, ""), &tokens, 16);
    RequestFeatures {
        ring_key: hashes[3],
        prompt_tokens: tokens.len() as u64,
        block_hashes: hashes,
        ..RequestFeatures::default()
    }
}

/// Token mode: every one of `replicas` replicas holds all of `prompt`'s blocks, as its
/// KV-event snapshot says.
pub fn held_everywhere(policy: &mut Policy, replicas: u32, prompt: &RequestFeatures) {
    for r in 0..replicas {
        let update = KvUpdate {
            snapshot: Some(KvSnapshot {
                version: KV_EVENTS_VERSION,
                seq: 0,
                block_size: 16,
                hashes: prompt.block_hashes.clone(),
                host_hashes: Vec::new(),
                disk_hashes: Vec::new(),
            }),
            batches: Vec::new(),
        };
        policy.apply_kv(ReplicaId(r), &update);
    }
}

/// Token mode: each prompt's blocks held by one replica, as its KV-event snapshot says.
pub fn setup_precise(replicas: u32) -> (Policy, Vec<ReplicaView>, Vec<RequestFeatures>) {
    let mut policy = members(replicas, PolicyConfig::default());
    let (prompts, updates) = token_prompts_held(replicas);
    for (r, update) in updates.iter().enumerate() {
        policy.apply_kv(ReplicaId(r as u32), update);
    }
    (policy, fleet(replicas), prompts)
}

/// Token mode as the gateway keeps it: the whole fleet state, each replica's blocks from its
/// KV-event snapshot as in [`setup_precise`].
pub fn setup_fleet_state(replicas: u32) -> (FleetState, Vec<RequestFeatures>) {
    let mut fleet = FleetState::new(PolicyConfig::default(), None);
    fleet.set_replicas(
        (0..replicas)
            .map(|i| {
                let name = name(i);
                let spec = ReplicaSpec {
                    url: name.clone(),
                    name,
                    models: vec!["m".into()],
                    labels: Default::default(),
                    max_in_flight: None,
                };
                (ReplicaId(i), spec)
            })
            .collect(),
    );
    let (prompts, updates) = token_prompts_held(replicas);
    for (r, update) in updates.iter().enumerate() {
        fleet.kv_events(ReplicaId(r as u32), update);
    }
    (fleet, prompts)
}

/// The indexed prompts, and each replica's KV-event snapshot holding every `replicas`-th
/// prompt's blocks.
fn token_prompts_held(replicas: u32) -> (Vec<RequestFeatures>, Vec<KvUpdate>) {
    let prompts: Vec<RequestFeatures> = (0..INDEXED_BLOCKS / BLOCKS_PER_PROMPT)
        .map(token_prompt)
        .collect();
    let mut held: Vec<Vec<u64>> = vec![Vec::new(); replicas as usize];
    for (i, p) in prompts.iter().enumerate() {
        held[i % replicas as usize].extend(&p.block_hashes);
    }
    let updates = held
        .into_iter()
        .map(|hashes| KvUpdate {
            snapshot: Some(KvSnapshot {
                version: KV_EVENTS_VERSION,
                seq: 0,
                block_size: 16,
                hashes,
                host_hashes: Vec::new(),
                disk_hashes: Vec::new(),
            }),
            batches: Vec::new(),
        })
        .collect();
    (prompts, updates)
}

fn name(i: u32) -> String {
    format!("http://10.0.{}.{}:8000", i / 256, i % 256)
}

fn members(replicas: u32, config: PolicyConfig) -> Policy {
    let mut policy = Policy::new(config);
    let names: Vec<String> = (0..replicas).map(name).collect();
    let members: Vec<(ReplicaId, &str)> = names
        .iter()
        .enumerate()
        .map(|(i, n)| (ReplicaId(i as u32), n.as_str()))
        .collect();
    policy.set_members(&members);
    policy
}

pub fn setup(replicas: u32) -> (Policy, Vec<ReplicaView>, Vec<RequestFeatures>) {
    let config = PolicyConfig {
        prefix_capacity: INDEXED_CHUNKS / replicas as usize + CHUNKS_PER_PROMPT,
        ..PolicyConfig::default()
    };
    let mut policy = members(replicas, config);
    let prompts: Vec<RequestFeatures> = (0..INDEXED_CHUNKS / CHUNKS_PER_PROMPT)
        .map(prompt)
        .collect();
    for (i, p) in prompts.iter().enumerate() {
        policy.record(ReplicaId(i as u32 % replicas), p);
    }
    (policy, fleet(replicas), prompts)
}

fn fleet(replicas: u32) -> Vec<ReplicaView> {
    (0..replicas)
        .map(|i| ReplicaView {
            id: ReplicaId(i),
            healthy: true,
            in_flight: i % 7,
            prefill_backlog: u64::from(i % 5) * 1_000,
            ..ReplicaView::default()
        })
        .collect()
}
