//! The engine adapters on recorded (llama.cpp) and documented-format (vLLM, SGLang) telemetry,
//! and the llama.cpp adapter against a live llama-server where one is installed.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvgate_agent::adapter::{for_engine, EngineLoad};

fn fixture(name: &str) -> Option<String> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    Some(std::fs::read_to_string(dir.join(name)).unwrap())
}

fn parse(engine: &str, bodies: &[Option<String>]) -> EngineLoad {
    for_engine(engine).unwrap().parse(bodies).unwrap()
}

#[test]
fn vllm_v1_metrics() {
    let s = parse(
        "vllm",
        &[fixture("vllm-v1-metrics.txt"), fixture("vllm-models.json")],
    );
    assert_eq!((s.running, s.waiting), (7, 2));
    assert_eq!(
        (s.kv_blocks_total, s.kv_blocks_used, s.block_size),
        (27584, 10344, 16)
    );
    assert_eq!(s.adapters, vec!["sql-lora", "chat-lora"]);
    assert_eq!(s.adapter_slots_free, Some(2));
    assert_eq!(
        s.models,
        vec!["meta-llama/Llama-3.1-8B-Instruct", "sql-lora"]
    );
}

#[test]
fn vllm_v0_metrics_use_the_older_cache_gauge() {
    let s = parse("vllm", &[fixture("vllm-v0-metrics.txt"), None]);
    assert_eq!((s.running, s.waiting), (3, 0));
    assert_eq!((s.kv_blocks_total, s.kv_blocks_used), (8000, 4000));
    assert!(s.adapters.is_empty() && s.adapter_slots_free.is_none());
    // No KV gauge at all is an error that names it.
    let err = for_engine("vllm")
        .unwrap()
        .parse(&[Some("vllm:num_requests_running 1\n".into())])
        .unwrap_err();
    assert!(err.contains("kv_cache_usage_perc"), "{err}");
}

#[test]
fn sglang_metrics() {
    let s = parse("sglang", &[fixture("sglang-metrics.txt"), None]);
    assert_eq!((s.running, s.waiting), (12, 4));
    assert_eq!(
        (s.kv_blocks_total, s.kv_blocks_used, s.block_size),
        (160_000, 44_800, 1)
    );
}

#[test]
fn llamacpp_slots_and_metrics_recorded_from_llama_server() {
    let s = parse(
        "llamacpp",
        &[
            fixture("llamacpp-slots.json"),
            fixture("llamacpp-metrics.txt"),
            fixture("llamacpp-models.json"),
        ],
    );
    // Two slots of 1024; one caches the 11 tokens of the finished completion.
    assert_eq!(
        (s.kv_blocks_total, s.kv_blocks_used, s.block_size),
        (2048, 11, 1)
    );
    assert_eq!((s.running, s.waiting), (0, 0));
    assert_eq!(s.models, vec!["models/SmolLM2-135M-Instruct.Q4_1.gguf"]);
    // Without /metrics (no --metrics flag) the slots still give KV and running.
    let s = parse("llamacpp", &[fixture("llamacpp-slots.json"), None, None]);
    assert_eq!(s.kv_blocks_used, 11);
}

#[test]
fn kvgate_stats_and_missing_bodies() {
    use kvgate_protocol::worker_stats::{DiskTierStats, EngineStats, WorkerStats};
    let stats = WorkerStats {
        model: "m".into(),
        adapters: vec!["sql".into()],
        adapter_slots_free: 1,
        max_loras: 2,
        engine: EngineStats {
            running: 2,
            waiting: 1,
            kv_blocks_total: 100,
            kv_blocks_free: 60,
            block_size: 16,
            ..Default::default()
        },
        ..Default::default()
    };
    let s = parse("kvgate", &[Some(serde_json::to_string(&stats).unwrap())]);
    assert_eq!((s.running, s.waiting, s.kv_blocks_used), (2, 1, 40));
    assert_eq!(s.models, vec!["m", "sql"]);
    assert_eq!(s.adapter_slots_free, Some(1));
    assert_eq!(s.host_block_value, None, "no offload tier");
    let mut offloading = stats.clone();
    offloading.engine.offload.load_cost = Some(0.25);
    let s = parse(
        "kvgate",
        &[Some(serde_json::to_string(&offloading).unwrap())],
    );
    assert_eq!(
        s.host_block_value,
        Some(0.75),
        "what loading a block back saves"
    );
    assert_eq!(s.disk_block_value, None, "no disk tier");
    offloading.engine.offload.disk = Some(DiskTierStats {
        load_cost: 0.4,
        ..DiskTierStats::default()
    });
    let s = parse(
        "kvgate",
        &[Some(serde_json::to_string(&offloading).unwrap())],
    );
    assert_eq!(s.disk_block_value, Some(0.6));
    let err = for_engine("kvgate").unwrap().parse(&[None]).unwrap_err();
    assert!(err.contains("/stats"), "{err}");
    // A body that is not the worker's contract says what is missing.
    let old = r#"{"model":"m","engine":{"running":2}}"#;
    let err = for_engine("kvgate")
        .unwrap()
        .parse(&[Some(old.into())])
        .unwrap_err();
    assert!(err.contains("missing field"), "{err}");
}

/// The llama.cpp adapter against a live llama-server, where `bench/peers/install-llama` has
/// built one (`KVGATE_PEERS`, default /tmp/kvgate-peers); says loudly when it is absent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn llamacpp_adapter_against_a_live_llama_server() {
    let peers = std::env::var("KVGATE_PEERS").unwrap_or_else(|_| "/tmp/kvgate-peers".into());
    let server = std::path::Path::new(&peers).join("llama.cpp/build/bin/llama-server");
    let model = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !server.exists() || !model.exists() {
        eprintln!(
            "\n\n*** SKIPPED: no llama-server at {} (bench/peers/install-llama builds it) ***\n\n",
            server.display()
        );
        return;
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    /// Kills llama-server however the test ends.
    struct Server(std::process::Child);
    impl Drop for Server {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _server = Server(
        std::process::Command::new(&server)
            .args([
                "-m",
                model.to_str().unwrap(),
                "-t",
                "1",
                "-np",
                "2",
                "-c",
                "1024",
                "--metrics",
            ])
            .args(["--port", &port.to_string()])
            .env("LD_LIBRARY_PATH", server.parent().unwrap())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let url = format!("http://127.0.0.1:{port}");
    let timeout = std::time::Duration::from_secs(1);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while kvgate_agent::http::get_text(&url, "/health", timeout)
        .await
        .is_err()
    {
        assert!(
            std::time::Instant::now() < deadline,
            "llama-server did not start"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    let adapter = for_engine("llamacpp").unwrap();
    let mut bodies = Vec::new();
    for path in adapter.paths() {
        bodies.push(kvgate_agent::http::get_text(&url, path, timeout).await.ok());
    }
    let s = adapter.parse(&bodies).unwrap();
    assert_eq!((s.kv_blocks_total, s.block_size), (1024, 1), "{s:?}");
    assert_eq!(s.models.len(), 1, "{s:?}");
}

#[test]
fn speculative_decoding_counters_are_reported_from_each_engine_that_has_them() {
    use kvgate_protocol::telemetry::SpecCounters;
    use kvgate_protocol::worker_stats::{EngineStats, SpecStats, WorkerStats};
    let metrics = "vllm:kv_cache_usage_perc 0.5\nvllm:spec_decode_num_drafts_total 10\n\
                   vllm:spec_decode_num_draft_tokens_total 40\n\
                   vllm:spec_decode_num_accepted_tokens_total 30\n";
    let v = parse("vllm", &[Some(metrics.into()), None]);
    let expected = SpecCounters {
        drafts: 10,
        draft_tokens: 40,
        accepted_tokens: 30,
    };
    assert_eq!(v.spec, Some(expected));
    assert_eq!(expected.acceptance_rate(), Some(0.75));
    let plain = parse(
        "vllm",
        &[Some("vllm:kv_cache_usage_perc 0.5\n".into()), None],
    );
    assert_eq!(plain.spec, None, "no speculation, nothing reported");
    let stats = WorkerStats {
        model: "m".into(),
        engine: EngineStats {
            spec: SpecStats {
                drafts: 10,
                draft_tokens: 40,
                accepted_tokens: 30,
                ..Default::default()
            },
            ..Default::default()
        },
        ..Default::default()
    };
    let k = parse("kvgate", &[Some(serde_json::to_string(&stats).unwrap())]);
    assert_eq!(k.spec, Some(expected));
}
