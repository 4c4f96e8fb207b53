//! The benchmark fleet: `replicas` replicas, 1M prefix chunks indexed across them.
#![allow(dead_code)]

use kvgate_policies::{Policy, PolicyConfig, ReplicaId, ReplicaView, RequestFeatures};
use kvgate_protocol::{text_chunk_hashes, HashSeed};

pub const INDEXED_CHUNKS: usize = 1_000_000;
pub const CHUNKS_PER_PROMPT: usize = 16;

pub fn prompt(i: usize) -> RequestFeatures {
    let text = format!("{i:>8}").repeat(CHUNKS_PER_PROMPT * 256 / 8);
    let chunks = text_chunk_hashes(HashSeed::new("bench", None, ""), text.as_bytes(), 256);
    RequestFeatures {
        ring_key: chunks[0],
        prefix_chunks: chunks,
        ..RequestFeatures::default()
    }
}

pub fn setup(replicas: u32) -> (Policy, Vec<ReplicaView>, Vec<RequestFeatures>) {
    let config = PolicyConfig {
        prefix_capacity: INDEXED_CHUNKS / replicas as usize + CHUNKS_PER_PROMPT,
        ..PolicyConfig::default()
    };
    let mut policy = Policy::new(config);
    let names: Vec<String> = (0..replicas)
        .map(|i| format!("http://10.0.{}.{}:8000", i / 256, i % 256))
        .collect();
    let members: Vec<(ReplicaId, &str)> = names
        .iter()
        .enumerate()
        .map(|(i, n)| (ReplicaId(i as u32), n.as_str()))
        .collect();
    policy.set_members(&members);
    let prompts: Vec<RequestFeatures> = (0..INDEXED_CHUNKS / CHUNKS_PER_PROMPT)
        .map(prompt)
        .collect();
    for (i, p) in prompts.iter().enumerate() {
        policy.record(ReplicaId(i as u32 % replicas), p);
    }
    let fleet = (0..replicas)
        .map(|i| ReplicaView {
            id: ReplicaId(i),
            healthy: true,
            in_flight: i % 7,
            max_in_flight: None,
            waiting: 0,
            stale: false,
            kv_usage: None,
            adapter_fit: 0.0,
        })
        .collect();
    (policy, fleet, prompts)
}
