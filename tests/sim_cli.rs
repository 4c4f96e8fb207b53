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
        "--policy",
        "kvgate",
        "--policy",
        "round-robin",
        "--out",
        out.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    for policy in ["kvgate", "round-robin"] {
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
        assert!(out.join(policy).join("requests.csv").exists());
        assert!(stdout.contains(&format!("| {policy} | 60 |")), "{stdout}");
    }
    std::fs::remove_dir_all(&out).unwrap();
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
    for (extra, expected) in [
        (
            vec![
                "--replicas",
                "4096",
                "--policy",
                "kvgate",
                "--workload",
                "shared-prefix",
            ],
            "lower --replicas or --num-blocks",
        ),
        (
            vec![
                "--replicas",
                "2",
                "--policy",
                "nope",
                "--workload",
                "shared-prefix",
            ],
            "unknown policy `nope` (known: kvgate, round-robin, least-load, sglang-cache-aware, vllm-consistent-hash)",
        ),
        (
            vec![
                "--replicas",
                "0",
                "--policy",
                "kvgate",
                "--workload",
                "shared-prefix",
            ],
            "--replicas must be between 1 and 4096",
        ),
        (
            vec![
                "--replicas",
                "1000000",
                "--policy",
                "kvgate",
                "--workload",
                "shared-prefix",
            ],
            "--replicas must be between 1 and 4096",
        ),
        (
            vec![
                "--replicas",
                "2",
                "--policy",
                "kvgate",
                "--workload",
                "zipf",
            ],
            "unknown workload `zipf`",
        ),
        (
            vec![
                "--replicas",
                "2",
                "--policy",
                "kvgate",
                "--workload",
                "mooncake:/nonexistent.jsonl",
            ],
            "/nonexistent.jsonl",
        ),
    ] {
        let mut args: Vec<&str> = base.to_vec();
        args.extend(extra);
        let o = sim(&args);
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(!o.status.success(), "{args:?} ran");
        assert!(text.contains(expected), "{args:?}: {text}");
        assert!(
            !std::path::Path::new("/tmp/kvgate-sim-never").exists(),
            "nothing written"
        );
    }
}
