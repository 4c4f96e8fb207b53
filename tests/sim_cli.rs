//! `kvgate sim` as users run it: results per policy, and bad input refused before anything runs.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;

fn sim(args: &[&str]) -> std::process::Output {
    kvgate().arg("sim").args(args).output().unwrap()
}

#[test]
fn each_policy_gets_the_summary_kvgate_bench_writes() {
    let out = std::env::temp_dir().join(format!("kvgate-sim-{}", std::process::id()));
    let o = sim(&[
        "--replicas",
        "4",
        "--gateways",
        "2",
        "--num-blocks",
        "2048",
        "--max-model-len",
        "8192",
        "--workload",
        "shared-prefix",
        "--groups",
        "6",
        "--prompts-per-group",
        "10",
        "--system-len",
        "512",
        "--question-len",
        "32",
        "--output-len",
        "8",
        "--rate",
        "20",
        "--requests",
        "60",
        // The oracle runs last, whatever its place: it starts from the others' routes.
        "--policy",
        "oracle",
        "--policy",
        "kvgate",
        "--policy",
        "round-robin",
        "--policy",
        "cache-first",
        "--policy",
        "llm-d",
        "--policy",
        "dynamo",
        "--out",
        out.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    for policy in [
        "kvgate",
        "round-robin",
        "cache-first",
        "llm-d",
        "dynamo",
        "oracle",
    ] {
        let summary: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(out.join(policy).join("summary.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(summary["requests"], 60, "{summary}");
        for key in [
            "ttft_s",
            "tpot_s",
            "e2e_s",
            "requests_per_s",
            "cached_token_ratio",
        ] {
            assert!(!summary[key].is_null(), "{policy}: no {key}");
        }
        for file in [
            "requests.csv",
            "replicas.csv",
            "replica_load.svg",
            "replica_kv.svg",
        ] {
            assert!(out.join(policy).join(file).exists(), "{policy}: no {file}");
        }
        assert!(stdout.contains(&format!("| {policy} | 60 |")), "{stdout}");
    }
    // Each replica sampled at 100 ms from 0 until the last job ends.
    let timeline = std::fs::read_to_string(out.join("kvgate").join("replicas.csv")).unwrap();
    assert!(
        timeline.starts_with(
            "t_s,replica,running,waiting,kv_blocks_used,kv_blocks_total\n0.000,sim-0,"
        ),
        "{timeline}"
    );
    assert!(timeline.lines().count() > 4 * 10, "{timeline}");
    assert!(stdout.contains("oracle bound holds"), "{stdout}");
    let ttft = |path: std::path::PathBuf| {
        let summary: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path.join("summary.json")).unwrap())
                .unwrap();
        summary["ttft_s"].clone()
    };
    let oracle = ttft(out.join("oracle"));
    for figure in ["mean", "p50", "p90"] {
        // Each figure is that of the oracle's routing for it, written beside.
        assert_eq!(
            oracle[figure],
            ttft(out.join("oracle").join(figure))[figure]
        );
        // The floor, over the first policy's requests, lies under every policy and the oracle.
        let floor = ttft(out.join("floor"))[figure].as_f64().unwrap();
        assert!(floor > 0.0 && floor <= oracle[figure].as_f64().unwrap());
        for policy in ["kvgate", "round-robin", "cache-first", "llm-d", "dynamo"] {
            let theirs = ttft(out.join(policy))[figure].as_f64().unwrap();
            assert!(
                oracle[figure].as_f64().unwrap() <= theirs,
                "{policy} {figure}"
            );
        }
    }
    assert!(stdout.contains("floor holds"), "{stdout}");
    assert!(out.join("floor").join("requests.csv").exists());
    std::fs::remove_dir_all(&out).unwrap();
}

#[test]
fn a_policy_file_runs_under_its_name_and_its_errors_name_the_yaml_path() {
    let dir = std::env::temp_dir().join(format!("kvgate-sim-policy-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = dir.join("wide.yaml");
    std::fs::write(&good, "preset: cache-first\nload_factor: 2.0\n").unwrap();
    let bad = dir.join("bad.yaml");
    std::fs::write(&bad, "policy:\n  load_factor: 1.5\n  weights: {prefx: 1}\n").unwrap();
    let out = dir.join("out");
    let args = |policy: &str| {
        vec![
            "--replicas".to_string(),
            "2".into(),
            "--workload".into(),
            "one-system-prompt".into(),
            "--system-len".into(),
            "256".into(),
            "--output-len".into(),
            "4".into(),
            "--concurrency".into(),
            "4".into(),
            "--requests".into(),
            "12".into(),
            "--num-blocks".into(),
            "2048".into(),
            "--max-model-len".into(),
            "4096".into(),
            "--policy".into(),
            policy.into(),
            "--out".into(),
            out.to_str().unwrap().into(),
        ]
    };
    let o = kvgate()
        .arg("sim")
        .args(args(good.to_str().unwrap()))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let summary: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("wide").join("summary.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(summary["requests"], 12, "{summary}");
    let o = kvgate()
        .arg("sim")
        .args(args(bad.to_str().unwrap()))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        text.contains(&format!("{}: line 3: policy.weights: ", bad.display()))
            && text.contains("prefx"),
        "{text}"
    );
    // A file named like the run's floor would write over it.
    let floor = dir.join("floor.yaml");
    std::fs::write(&floor, "preset: balanced\n").unwrap();
    let o = kvgate()
        .arg("sim")
        .args(args(floor.to_str().unwrap()))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && text.contains("names the run's floor"),
        "{text}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_malformed_trace_is_named_by_file_and_line() {
    let trace = std::env::temp_dir().join(format!("kvgate-sim-trace-{}.jsonl", std::process::id()));
    std::fs::write(
        &trace,
        "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 5, \"hash_ids\": [1]}\n{\"timestamp\": 1, \"input_length\": \"x\"}\n",
    )
    .unwrap();
    let workload = format!("mooncake:{}", trace.display());
    let o = sim(&[
        "--replicas",
        "2",
        "--workload",
        &workload,
        "--requests",
        "5",
        "--policy",
        "kvgate",
        "--out",
        "/tmp/kvgate-sim-never",
    ]);
    let text = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        text.contains(&format!("{} line 2", trace.display())),
        "{text}"
    );
    std::fs::remove_file(&trace).unwrap();
}

#[test]
fn bad_input_is_refused_with_its_reason() {
    let base = [
        "--rate",
        "1",
        "--requests",
        "1",
        "--out",
        "/tmp/kvgate-sim-never",
    ];
    // Each case: its flags, and what the refusal says.
    for (extra, expected) in [
        (
            "--replicas 4096 --policy kvgate --workload shared-prefix",
            "lower --replicas, --num-blocks or --gateways",
        ),
        (
            "--replicas 2 --policy nope --workload shared-prefix",
            "unknown policy `nope` (known: kvgate, round-robin, least-load, sglang-cache-aware, vllm-consistent-hash, llm-d, dynamo, soonest-first-token, oracle; the presets balanced, cache-first, latency-first; or a policy YAML file)",
        ),
        (
            "--replicas 0 --policy kvgate --workload shared-prefix",
            "--replicas must be between 1 and 4096",
        ),
        (
            "--replicas 1024 --num-blocks 8192 --policy oracle --workload shared-prefix",
            "copies every replica's engine for each request",
        ),
        (
            "--replicas 2 --gateways 100000 --policy kvgate --workload shared-prefix",
            "--gateways must be between 1 and 256, got 100000",
        ),
        (
            "--replicas 1000000 --policy kvgate --workload shared-prefix",
            "--replicas must be between 1 and 4096",
        ),
        (
            "--replicas 2 --policy kvgate --workload zipf",
            "unknown workload `zipf`",
        ),
        (
            "--replicas 2 --policy kvgate --workload shared-prefix --gateway-delay-ms 70000",
            "--gateway-delay-ms must be between 0 and 60000, got 70000",
        ),
        (
            "--replicas 2 --policy kvgate --workload shared-prefix --block-size 0",
            "--block-size must be between 1 and 1024 and --max-model-len at least 1, got 0 and 32768",
        ),
        (
            "--replicas 2 --policy kvgate --workload shared-prefix --num-blocks 1",
            "the KV cache holds 16 tokens (1 blocks of 16), less than one request of the context length",
        ),
        (
            "--replicas 2 --policy kvgate --workload shared-prefix --report-delay-ms 18446744073709551615",
            "--report-delay-ms must be between 0 and 3600000, got 18446744073709551615",
        ),
        (
            "--replicas 2 --policy kvgate --workload shared-prefix --gateway-exchange-ms 3600001",
            "--gateway-exchange-ms must be between 0 and 3600000, got 3600001",
        ),
        (
            "--replicas 2 --policy oracle --workload shared-prefix --oracle-replays 1000000",
            "--oracle-replays must be at most 10000, got 1000000",
        ),
        (
            "--replicas 2 --policy kvgate --workload shared-prefix --worker-time-scale 0",
            "--worker-time-scale must be a positive number, got 0",
        ),
        (
            "--replicas 2 --policy kvgate --policy kvgate --workload shared-prefix",
            "a second policy named `kvgate`",
        ),
        (
            "--replicas 2 --policy kvgate --workload mooncake:/nonexistent.jsonl",
            "/nonexistent.jsonl",
        ),
        (
            "--replicas 2 --prefill-replicas 1 --policy round-robin --workload shared-prefix",
            "routed by kvgate's policies only",
        ),
        (
            "--replicas 2 --prefill-replicas 2 --policy kvgate --workload shared-prefix",
            "2 prefill replicas leave none of the 2 to decode",
        ),
    ] {
        let mut args: Vec<&str> = base.to_vec();
        args.extend(extra.split_whitespace());
        let o = sim(&args);
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(!o.status.success(), "{args:?} ran");
        assert!(text.contains(expected), "{args:?}: {text}");
        // Refused before anything runs: not even the table's header.
        assert!(o.stdout.is_empty(), "{args:?}: {text}");
        assert!(
            !std::path::Path::new("/tmp/kvgate-sim-never").exists(),
            "nothing written"
        );
    }
}
