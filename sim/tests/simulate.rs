//! The simulator on a shared-prefix workload: every request ends, runs repeat exactly, and
//! kvgate's policy finds the prefixes that round-robin scatters.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvgate_bench::{Load, Workload};
use kvgate_sim::{search_oracle, simulate, Figure, Outcome, Policy, Router, SimConfig, Starts};
use kvgate_worker::spec::{Method, NgramSettings, SpecConfig};

mod common;
use common::{config, every_run};

fn shared_prefix() -> Workload {
    Workload::SharedPrefix {
        groups: 8,
        prompts_per_group: 25,
        system_len: 1_024,
        question_len: 32,
        output_len: 16,
    }
}

fn cached_ratio(o: &Outcome) -> f64 {
    let sum = |f: fn(&kvgate_bench::RequestRecord) -> Option<u64>| {
        o.records.iter().filter_map(f).sum::<u64>() as f64
    };
    sum(|r| r.cached_tokens) / sum(|r| r.prompt_tokens)
}

#[test]
fn every_request_ends_and_a_run_repeats_exactly() {
    let jobs = shared_prefix().jobs(200, 1).unwrap();
    let run = || {
        simulate(
            &config(4, 2),
            &jobs,
            Load::Rate(40.0),
            &Router::Kvgate(Default::default()),
        )
        .unwrap()
    };
    let (a, b) = (run(), run());
    assert_eq!(a.records.len(), 200);
    assert!(a
        .records
        .iter()
        .all(|r| r.ttft_s.is_some() && r.output_tokens == Some(16)));
    let key = |o: &Outcome| -> Vec<(String, u64)> {
        o.records
            .iter()
            .map(|r| (r.replica.clone().unwrap(), (r.e2e_s * 1e6) as u64))
            .collect()
    };
    assert_eq!(key(&a), key(&b));
    assert!(a.simulated_s > 0.0 && a.events > 0);
}

#[test]
fn kvgate_finds_the_prefixes_round_robin_scatters() {
    let jobs = shared_prefix().jobs(200, 2).unwrap();
    let fleet = config(4, 1);
    let kvgate = simulate(
        &fleet,
        &jobs,
        Load::Rate(40.0),
        &Router::Kvgate(Default::default()),
    )
    .unwrap();
    let rr = simulate(&fleet, &jobs, Load::Rate(40.0), &Router::RoundRobin).unwrap();
    let sglang = simulate(&fleet, &jobs, Load::Rate(40.0), &Router::SglangCacheAware).unwrap();
    let (k, r, s) = (
        cached_ratio(&kvgate),
        cached_ratio(&rr),
        cached_ratio(&sglang),
    );
    eprintln!("cached ratio: kvgate {k:.3}, round-robin {r:.3}, sglang-cache-aware {s:.3}");
    assert!(s > r + 0.05, "sglang's tree finds them too: {s:.3}");
    // 8 groups over 4 replicas: round-robin computes each system prompt on every replica.
    assert!(k > r + 0.05, "kvgate {k:.3}, round-robin {r:.3}");
}

#[test]
fn closed_loop_and_multi_turn_sessions_run_turn_after_turn() {
    let jobs = Workload::MultiTurn {
        turns: 4,
        system_len: 256,
        turn_len: 32,
        output_len: 8,
    }
    .jobs(40, 3)
    .unwrap();
    let o = simulate(
        &config(2, 1),
        &jobs,
        Load::Concurrency(4),
        &Router::Kvgate(Default::default()),
    )
    .unwrap();
    assert_eq!(o.records.len(), 40);
    // Later turns carry the earlier ones: their prompts grow and are mostly cached.
    let late: Vec<_> = o
        .records
        .iter()
        .filter(|r| r.prompt_tokens.unwrap() > 400)
        .collect();
    assert!(!late.is_empty());
    assert!(
        late.iter().all(|r| r.cached_tokens.unwrap() > 0),
        "sessions stick to their replica"
    );
}

/// Every replica drafting at `acceptance` (`None`: no speculation).
fn speculating(acceptance: Option<f64>) -> SimConfig {
    let ngram = NgramSettings::new(2, 4).unwrap();
    SimConfig {
        speculation: acceptance.map(|acceptance| {
            SpecConfig::new(Method::Modelled { acceptance }, 8, ngram, None).unwrap()
        }),
        ..config(2, 1)
    }
}

fn p50_tpot(o: &Outcome) -> f64 {
    let mut tpot: Vec<f64> = o
        .records
        .iter()
        .map(|r| (r.e2e_s - r.ttft_s.unwrap()) / (r.output_tokens.unwrap() - 1) as f64)
        .collect();
    tpot.sort_by(f64::total_cmp);
    tpot[tpot.len() / 2]
}

#[test]
fn speculation_shortens_decoding_as_its_acceptance_allows() {
    let jobs = Workload::SharedPrefix {
        groups: 4,
        prompts_per_group: 10,
        system_len: 512,
        question_len: 32,
        output_len: 64,
    }
    .jobs(40, 5)
    .unwrap();
    let run = |acceptance| {
        let fleet = speculating(acceptance);
        simulate(&fleet, &jobs, Load::Rate(4.0), &Router::RoundRobin).unwrap()
    };
    let plain = run(None);
    let tpot = |o: &Outcome| p50_tpot(o) / p50_tpot(&plain);
    let (never, half, mostly) = (run(Some(0.0)), run(Some(0.5)), run(Some(0.9)));
    eprintln!(
        "P50 TPOT over plain: acceptance 0: {:.3}, 0.5: {:.3}, 0.9: {:.3}",
        tpot(&never),
        tpot(&half),
        tpot(&mostly)
    );
    for o in [&never, &half, &mostly] {
        assert!(o.records.iter().all(|r| r.output_tokens == Some(64)));
    }
    // A verification step of a few tokens costs about one token's step on a GPU: the more
    // kept, the shorter; drafts that are never kept soon stop being tried.
    assert!(tpot(&mostly) < 0.5 * tpot(&half), "{}", tpot(&mostly));
    assert!(tpot(&half) < 0.9, "{}", tpot(&half));
    assert!(tpot(&never) < 1.1, "{}", tpot(&never));
}

#[test]
fn a_fleet_without_replicas_is_refused() {
    let jobs = shared_prefix().jobs(1, 1).unwrap();
    let e = simulate(&config(0, 1), &jobs, Load::Rate(1.0), &Router::RoundRobin).unwrap_err();
    assert!(e.contains("at least one replica"), "{e}");
    assert!(Policy::named("nope").unwrap_err().contains("known: kvgate"));
}

#[test]
fn a_prompt_over_the_context_length_fails_alone() {
    let mut jobs = shared_prefix().jobs(20, 4).unwrap();
    jobs[3].turns[0].user = " word".repeat(10_000);
    let o = simulate(
        &config(2, 1),
        &jobs,
        Load::Rate(10.0),
        &Router::Kvgate(Default::default()),
    )
    .unwrap();
    assert_eq!(o.records.len(), 20);
    let failed: Vec<_> = o.records.iter().filter(|r| r.status != 200).collect();
    assert_eq!(failed.len(), 1);
    assert!(
        failed[0].error.as_ref().unwrap().contains("context length"),
        "{:?}",
        failed[0].error
    );
}

#[test]
fn least_load_spreads_requests_evenly() {
    let jobs = shared_prefix().jobs(200, 5).unwrap();
    let o = simulate(
        &config(4, 1),
        &jobs,
        Load::Concurrency(8),
        &Router::LeastLoad,
    )
    .unwrap();
    let mut per: std::collections::BTreeMap<String, usize> = Default::default();
    for r in &o.records {
        *per.entry(r.replica.clone().unwrap()).or_default() += 1;
    }
    assert_eq!(per.len(), 4);
    let (most, fewest) = (per.values().max().unwrap(), per.values().min().unwrap());
    assert!(most - fewest <= 10, "{per:?}");
}

#[test]
fn a_job_without_turns_ends_at_once() {
    let mut jobs = shared_prefix().jobs(3, 6).unwrap();
    jobs[1].turns.clear();
    let o = simulate(
        &config(1, 1),
        &jobs,
        Load::Concurrency(1),
        &Router::RoundRobin,
    )
    .unwrap();
    assert_eq!(o.records.len(), 2);
}

/// Every router on the same arrivals, each run's summary under its name.
fn every_router(
    fleet: &SimConfig,
    jobs: &[kvgate_bench::Job],
    load: Load,
) -> Vec<(String, kvgate_bench::Summary)> {
    every_run(fleet, jobs, load)
        .into_iter()
        .map(|(name, o)| {
            let s =
                kvgate_bench::summarize(&o.records, Default::default(), None, Default::default());
            (name, s)
        })
        .collect()
}

#[test]
fn one_request_at_a_time_no_router_beats_the_look_ahead() {
    // With nothing else in flight a request's soonest first token is the whole story, so
    // sending each where it comes soonest is the best routing (under load it is not:
    // BENCHMARKS.md).
    let shared = shared_prefix().jobs(120, 4).unwrap();
    let sessions = Workload::MultiTurn {
        turns: 5,
        system_len: 512,
        turn_len: 64,
        output_len: 16,
    }
    .jobs(100, 5)
    .unwrap();
    for jobs in [&shared, &sessions] {
        let results = every_router(&config(4, 1), jobs, Load::Concurrency(1));
        let ttft = |name: &str| results.iter().find(|(n, _)| n == name).unwrap().1.ttft_s;
        let soonest = ttft("soonest-first-token");
        for (name, s) in &results {
            let s = s.ttft_s;
            assert!(
                soonest.mean <= s.mean && soonest.p50 <= s.p50 && soonest.p90 <= s.p90,
                "{name}: {s:?} below the look-ahead's {soonest:?}"
            );
        }
    }
}

#[test]
fn replaying_a_runs_routes_runs_it_again() {
    let fleet = config(4, 2);
    let sessions = Workload::MultiTurn {
        turns: 4,
        system_len: 256,
        turn_len: 64,
        output_len: 16,
    }
    .jobs(60, 3)
    .unwrap();
    let shared = shared_prefix().jobs(150, 3).unwrap();
    for (jobs, load) in [
        (&sessions, Load::Concurrency(12)),
        (&shared, Load::Rate(60.0)),
    ] {
        for router in [Router::SglangCacheAware, Router::Kvgate(Default::default())] {
            let run = simulate(&fleet, jobs, load, &router).unwrap();
            let routes = std::sync::Arc::new(run.routes.clone());
            let again = simulate(&fleet, jobs, load, &Router::Replay(routes)).unwrap();
            assert_eq!(again.routes, run.routes, "{router:?}");
            assert_eq!(
                format!("{:?}", again.records),
                format!("{:?}", run.records),
                "{router:?}"
            );
        }
    }
}

#[test]
fn the_oracle_is_never_above_its_starts_and_improves_on_a_poor_one() {
    let fleet = config(4, 1);
    let jobs = shared_prefix().jobs(200, 8).unwrap();
    let load = Load::Rate(80.0);
    let runs = every_run(&fleet, &jobs, load);
    let stats = |o: &Outcome| {
        kvgate_bench::summarize(&o.records, Default::default(), None, Default::default()).ttft_s
    };
    for figure in kvgate_sim::FIGURES {
        let starts = Starts::new(runs.clone()).unwrap();
        let found = search_oracle(&fleet, &jobs, load, &starts, figure, 12, &mut |_| {}).unwrap();
        let ours = figure.of(&stats(&found.outcome));
        for (name, run) in &runs {
            assert!(ours <= figure.of(&stats(run)), "{name}'s {figure:?}");
        }
        assert!(found.replays <= 12);
    }
    // From round-robin's routes alone (cold prefixes on every replica), moving the turns that
    // set the P90 lowers it.
    let rr: Vec<_> = runs
        .into_iter()
        .filter(|(n, _)| n == "round-robin")
        .collect();
    let from_rr = Starts::new(rr.clone()).unwrap();
    let found = search_oracle(&fleet, &jobs, load, &from_rr, Figure::P90, 16, &mut |_| {}).unwrap();
    assert!(found.kept > 0);
    assert!(stats(&found.outcome).p90 < stats(&rr[0].1).p90);
}

#[test]
fn llm_d_and_dynamo_find_held_prefixes() {
    let jobs = shared_prefix().jobs(200, 6).unwrap();
    let fleet = config(4, 2);
    let ratio =
        |router: Router| cached_ratio(&simulate(&fleet, &jobs, Load::Rate(40.0), &router).unwrap());
    let rr = ratio(Router::RoundRobin);
    for router in [Router::Llmd, Router::Dynamo] {
        let r = ratio(router.clone());
        assert!(
            r > rr + 0.02,
            "{router:?}: {r:.3} against round-robin's {rr:.3}"
        );
    }
}

#[test]
fn a_gateway_delay_adds_to_every_ttft() {
    let jobs = shared_prefix().jobs(20, 8).unwrap();
    let run = |delay_us: u64| {
        let fleet = SimConfig {
            gateway_delay_us: delay_us,
            ..config(1, 1)
        };
        simulate(&fleet, &jobs, Load::Concurrency(1), &Router::RoundRobin).unwrap()
    };
    let (plain, delayed) = (run(0), run(25_000));
    // One request at a time: each meets the same engine state, 25 ms later.
    for (a, b) in plain.records.iter().zip(&delayed.records) {
        let (a, b) = (a.ttft_s.unwrap(), b.ttft_s.unwrap());
        assert!((b - a - 0.025).abs() < 1e-6, "{a} then {b}");
    }
    assert!(delayed.simulated_s > plain.simulated_s + 20.0 * 0.025 - 1e-6);
}

#[test]
fn gateway_jitter_draws_each_delay_from_its_range_by_seed() {
    let jobs = shared_prefix().jobs(20, 9).unwrap();
    let run = |jitter_us: u64, jitter_seed: u64| {
        let fleet = SimConfig {
            gateway_delay_us: 10_000,
            gateway_jitter_us: jitter_us,
            jitter_seed,
            ..config(1, 1)
        };
        simulate(&fleet, &jobs, Load::Concurrency(1), &Router::RoundRobin).unwrap()
    };
    let ttfts = |o: &Outcome| {
        o.records
            .iter()
            .map(|r| r.ttft_s.unwrap())
            .collect::<Vec<_>>()
    };
    let (fixed, a, b) = (
        ttfts(&run(0, 0)),
        ttfts(&run(4_000, 1)),
        ttfts(&run(4_000, 2)),
    );
    for (f, j) in fixed.iter().zip(&a) {
        assert!((0.0..0.004).contains(&(j - f)), "{f} then {j}");
    }
    assert_ne!(a, b, "another seed, other draws");
    assert_eq!(a, ttfts(&run(4_000, 1)), "the same seed, the same draws");
}

/// kvgate through `gateways` gateways, exchanging decisions and backlogs after
/// `exchange_delay_ms` (or not at all).
fn through_gateways(
    gateways: usize,
    exchange_delay_ms: Option<u64>,
    jobs: &[kvgate_bench::Job],
    rate: f64,
) -> Outcome {
    let fleet = SimConfig {
        exchange_delay_ms,
        ..config(4, gateways)
    };
    simulate(
        &fleet,
        jobs,
        Load::Rate(rate),
        &Router::Kvgate(Default::default()),
    )
    .unwrap()
}

/// 400 requests in 16 groups of a 1k-token system prompt.
fn sixteen_groups_of_1k(seed: u64) -> Vec<kvgate_bench::Job> {
    Workload::SharedPrefix {
        groups: 16,
        prompts_per_group: 25,
        system_len: 1024,
        question_len: 64,
        output_len: 32,
    }
    .jobs(400, seed)
    .unwrap()
}

/// How many replicas each prefix group's requests went to, on average.
fn replicas_per_group(o: &Outcome) -> f64 {
    let mut groups: std::collections::BTreeMap<&str, std::collections::BTreeSet<&str>> =
        Default::default();
    for r in &o.records {
        if let (Some(g), Some(rep)) = (&r.group, &r.replica) {
            groups.entry(g).or_default().insert(rep);
        }
    }
    groups.values().map(|r| r.len()).sum::<usize>() as f64 / groups.len() as f64
}

#[test]
fn a_replicas_first_report_does_not_make_the_groups_sent_to_it_look_cold() {
    // 16 groups arrive within the first report interval: each replica's first report (a KV
    // snapshot taken before it computed them) once erased the gateway's guesses, and the
    // groups' next requests split over 1.3 replicas each at 0.9 of capacity. The copies left
    // (one or two of the 16 groups, 1.06-1.13 replicas each) come after every first report,
    // when the queues have grown.
    for seed in [1, 2, 3] {
        let jobs = sixteen_groups_of_1k(seed);
        let fleet = SimConfig {
            seed,
            ..config(4, 1)
        };
        let router = Router::Kvgate(Default::default());
        let o = simulate(&fleet, &jobs, Load::Rate(385.0), &router).unwrap();
        let spread = replicas_per_group(&o);
        assert!(spread < 1.15, "seed {seed}: {spread} replicas per group");
    }
}

#[test]
fn gateways_that_exchange_decisions_agree_on_where_prefixes_live() {
    let jobs = sixteen_groups_of_1k(2);
    let replicas_per_group = |exchange_delay_ms| {
        replicas_per_group(&through_gateways(8, exchange_delay_ms, &jobs, 390.0))
    };
    let (alone, told) = (replicas_per_group(None), replicas_per_group(Some(5)));
    assert!(
        told < alone,
        "{told} replicas per group, {alone} without the exchange"
    );
}

#[test]
fn gateways_that_exchange_backlogs_spread_one_system_prompt_as_one_gateway_does() {
    let jobs = Workload::SharedPrefix {
        groups: 1,
        prompts_per_group: 400,
        system_len: 1024,
        question_len: 64,
        output_len: 32,
    }
    .jobs(400, 3)
    .unwrap();
    let p90 = |gateways, exchange_delay_ms| {
        let o = through_gateways(gateways, exchange_delay_ms, &jobs, 480.0);
        let mut ttft: Vec<f64> = o.records.iter().filter_map(|r| r.ttft_s).collect();
        ttft.sort_by(f64::total_cmp);
        ttft[ttft.len() * 9 / 10]
    };
    let (one, told) = (p90(1, None), p90(8, Some(2)));
    // Each of 8 gateways seeing only its own backlog piles onto the replicas that look idle
    // to it: 2.4x one gateway's P90 with decisions exchanged and backlogs not.
    assert!(
        told < 1.15 * one,
        "P90 {told} s through 8 gateways, {one} s through one"
    );
}

#[test]
fn a_host_tier_brings_evicted_prefixes_back_cheaper_than_prefill() {
    // 8 groups of a 2k-token system prompt (128 blocks each) on a replica of 600 blocks:
    // groups taking turns evict each other's prefixes.
    let jobs = Workload::SharedPrefix {
        groups: 8,
        prompts_per_group: 8,
        system_len: 2_048,
        question_len: 32,
        output_len: 8,
    }
    .jobs(64, 3)
    .unwrap();
    let run = |offload_bytes| {
        let fleet = SimConfig {
            num_blocks: Some(600),
            offload_bytes,
            ..config(1, 1)
        };
        simulate(&fleet, &jobs, Load::Rate(2.0), &Router::RoundRobin).unwrap()
    };
    let (plain, tiered) = (run(0), run(8 << 30));
    let cached = |o: &Outcome| -> u64 { o.records.iter().map(|r| r.cached_tokens.unwrap()).sum() };
    let ttft = |o: &Outcome| -> f64 {
        let mut t: Vec<f64> = o.records.iter().map(|r| r.ttft_s.unwrap()).collect();
        t.sort_by(f64::total_cmp);
        t[t.len() / 2]
    };
    assert!(
        cached(&tiered) > cached(&plain) * 3 / 2,
        "cached tokens: {} with the tier, {} without",
        cached(&tiered),
        cached(&plain)
    );
    assert!(
        ttft(&tiered) < ttft(&plain),
        "P50 TTFT {} s with the tier, {} s without",
        ttft(&tiered),
        ttft(&plain)
    );
}

/// Long random prompts (no shared prefixes) on a fleet of `prefill` prefill replicas out of 4,
/// and the short ones under `min_prompt` going to decode replicas whole.
fn disaggregated(prefill: usize, min_prompt: usize) -> Outcome {
    let workload = Workload::Random {
        input_mean: 2_048.0,
        input_sigma: 0.25,
        output_mean: 32.0,
        output_sigma: 0.0,
    };
    let jobs = workload.jobs(60, 3).unwrap();
    let mut fleet = config(4, 1);
    fleet.prefill_replicas = prefill;
    fleet.pd_min_prompt_tokens = min_prompt;
    simulate(
        &fleet,
        &jobs,
        Load::Concurrency(8),
        &Router::Kvgate(Default::default()),
    )
    .unwrap()
}

#[test]
fn a_disaggregated_fleet_hands_every_prompt_from_a_prefill_replica_to_a_decode_one() {
    let o = disaggregated(2, 0);
    assert_eq!(
        o.records.len(),
        60,
        "each request recorded once, its prefill leg not"
    );
    for r in &o.records {
        let replica = r.replica.as_deref().unwrap();
        assert!(
            ["sim-2", "sim-3"].contains(&replica),
            "answered by a decode replica: {replica}"
        );
        let full_blocks = (r.prompt_tokens.unwrap() - 1) / 16 * 16;
        assert_eq!(
            r.cached_tokens,
            Some(full_blocks),
            "every full block handed over"
        );
        assert_eq!(r.itl_s.len(), 31, "a gap between each two of its 32 tokens");
    }
    let colocated = disaggregated(0, 0);
    assert_eq!(cached_ratio(&colocated), 0.0, "nothing shared to reuse");
    assert!(colocated.records.iter().all(|r| r.itl_s.len() == 31));
}

#[test]
fn prompts_under_the_pools_minimum_skip_the_prefill_leg() {
    let o = disaggregated(2, 1_000_000);
    assert_eq!(o.records.len(), 60);
    assert_eq!(cached_ratio(&o), 0.0, "computed where they were answered");
    assert!(o
        .records
        .iter()
        .all(|r| ["sim-2", "sim-3"].contains(&r.replica.as_deref().unwrap())));
}

#[test]
fn a_fleet_of_prefill_replicas_alone_is_refused() {
    let mut fleet = config(2, 1);
    fleet.prefill_replicas = 2;
    assert!(fleet.check().unwrap_err().contains("none"));
}
