//! The floor under a run's TTFTs: met by a request alone on a replica that holds what was sent
//! before it (exactly when its prefill takes one step), and beaten by no router under load.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{config, every_run};
use kvgate_bench::{Job, Load, Workload};
use kvgate_sim::{below_floor, floor_records, simulate, Outcome, Router};

/// The scheduler's budget of tokens a step.
const STEP_TOKENS: u64 = 2_048;

fn shared_prefix(question_len: usize) -> Vec<Job> {
    // System prompts longer than a step's budget, so that prefills take several chunks.
    Workload::SharedPrefix {
        groups: 3,
        prompts_per_group: 8,
        system_len: 3_008,
        question_len,
        output_len: 4,
    }
    .jobs(24, 2)
    .unwrap()
}

/// Turns long enough that their prefill is compute-bound (16 tokens more or less show), each
/// prompt and answer ending on a block's edge (so the answer's last token, never computed,
/// decides whether its block is reused).
fn sessions() -> Vec<Job> {
    Workload::MultiTurn {
        turns: 4,
        system_len: 256,
        turn_len: 400,
        output_len: 608,
    }
    .jobs(12, 3)
    .unwrap()
}

fn ttft_us(o: &Outcome) -> Vec<u64> {
    o.records
        .iter()
        .map(|r| (r.ttft_s.unwrap() * 1e6).round() as u64)
        .collect()
}

#[test]
fn a_request_alone_on_a_replica_holding_what_came_before_meets_its_floor() {
    let mut fleet = config(1, 1);
    fleet.gateway_delay_us = 300;
    fleet.gateway_jitter_us = 200;
    // Questions (a prefix shared in whole blocks), none (the same prompt again: all but the
    // last token's block reused), and sessions (each turn reusing the last one's answer).
    for jobs in [shared_prefix(700), shared_prefix(0), sessions()] {
        let o = simulate(&fleet, &jobs, Load::Concurrency(1), &Router::RoundRobin).unwrap();
        let floors = floor_records(&o.records, &o.floors_us);
        assert_eq!(
            floors.len(),
            jobs.iter().map(|j| j.turns.len()).sum::<usize>()
        );
        let floor_us = floors
            .iter()
            .map(|r| (r.ttft_s.unwrap() * 1e6).round() as u64);
        let mut exact = 0;
        for ((r, ttft), floor) in o.records.iter().zip(ttft_us(&o)).zip(floor_us) {
            let computed = r.prompt_tokens.unwrap() - r.cached_tokens.unwrap();
            if computed <= STEP_TOKENS {
                // One step: exactly its time.
                assert_eq!(ttft, floor, "request {}", r.index);
                exact += 1;
            } else {
                // Several: no split beats the floor, and the scheduler's is within a step
                // that only reads the weights (about 4 ms on this profile).
                assert!(
                    floor <= ttft && ttft <= floor + 4_500,
                    "request {}: {ttft} against {floor}",
                    r.index
                );
            }
        }
        assert!(exact > 0);
        assert!(o.records.iter().any(|r| r.cached_tokens.unwrap() > 0));
    }
}

#[test]
fn no_router_beats_the_floor_under_load() {
    let mut fleet = config(4, 2);
    fleet.gateway_delay_us = 200;
    fleet.gateway_jitter_us = 500;
    let runs = [
        (shared_prefix(64), Load::Rate(80.0)),
        (sessions(), Load::Concurrency(8)),
    ];
    for (jobs, load) in runs {
        for (name, o) in every_run(&fleet, &jobs, load) {
            assert_eq!(below_floor(&o.records, &o.floors_us), Vec::<String>::new());
            // Queues and lost reuse: under this load some requests wait past their floor.
            let floors = floor_records(&o.records, &o.floors_us);
            let above = ttft_us(&o)
                .iter()
                .zip(&floors)
                .filter(|(t, f)| **t > (f.ttft_s.unwrap() * 1e6).round() as u64)
                .count();
            assert!(above > 0, "{name}: every request at its floor under load");
        }
    }
}
