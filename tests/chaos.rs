//! The chaos suite: a fleet on loopback under steady load from `kvgate bench`, while workers
//! are killed, hung, slowed, made to answer garbage or 500s or drop streams mid-way, agents
//! are killed, and the gateway is reloaded, stopped and upgraded to a new process, with
//! slowloris clients beside the load. Each scenario says what may fail — only requests on the
//! worker at fault — and asserts that nothing else does.
//!
//! Scenarios run one at a time, each loading its fleet for `KVGATE_CHAOS_SECONDS` (default 6);
//! a soak: `KVGATE_CHAOS_SECONDS=120 cargo test --release --test chaos`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One fleet at a time: two cores hold one loaded fleet, not several.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn seconds() -> f64 {
    std::env::var("KVGATE_CHAOS_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(6.0)
}

/// One request as the bench saw it.
#[derive(Debug, Clone)]
struct Row {
    start_s: f64,
    end_s: f64,
    replica: Option<String>,
    error: Option<String>,
}

/// `kvgate bench` running against a gateway.
struct Load {
    proc: Proc,
    out: tempfile::TempDir,
    started: Instant,
}

impl Load {
    /// Streamed chats of about 64 prompt and 16 output tokens, `rate` a second (Poisson) for
    /// `seconds`.
    fn start(url: &str, rate: f64, seconds: f64) -> Load {
        let out = temp_dir("chaos-load");
        let mut cmd = kvgate();
        cmd.args([
            "bench",
            "--url",
            url,
            "--workload",
            "random",
            "--model",
            MODEL,
        ])
        .args([
            "--rate",
            &rate.to_string(),
            "--duration-s",
            &seconds.to_string(),
        ])
        // Jobs are made up front: twice the number expected, not a million.
        .args([
            "--requests",
            &((rate * seconds * 2.0) as usize + 10).to_string(),
        ])
        .args(["--input-mean", "64", "--output-mean", "16"])
        .args(["--header", "x-kvgate-debug: 1", "--quiet", "--out"])
        .arg(out.path());
        Load {
            proc: spawn(cmd, &format!("bench-{}", free_port())),
            out,
            started: Instant::now(),
        }
    }

    /// Seconds since the load started (the bench's own clock starts a little later).
    fn now_s(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    async fn at(&self, seconds: f64) {
        let left = seconds - self.now_s();
        if left > 0.0 {
            tokio::time::sleep(Duration::from_secs_f64(left)).await;
        }
    }

    /// Waits for the bench to end; every request it sent.
    fn finish(mut self) -> Vec<Row> {
        let status = self.proc.child.wait().unwrap();
        assert!(status.success(), "the bench failed: {status}");
        let csv = std::fs::read_to_string(self.out.path().join("requests.csv")).unwrap();
        let rows: Vec<Row> = csv.lines().skip(1).map(row).collect();
        assert!(rows.len() > 10, "hardly any load: {} requests", rows.len());
        rows
    }
}

/// A `requests.csv` line: `index,warmup,start_s,status,ttft_s,tpot_s,e2e_s,prompt_tokens,
/// output_tokens,cached_tokens,replica,group,"route","error"`.
fn row(line: &str) -> Row {
    let fields: Vec<&str> = line.splitn(13, ',').collect();
    let error = fields[12]
        .rsplit("\",\"")
        .next()
        .unwrap()
        .trim_end_matches('"');
    let start_s: f64 = fields[2].parse().unwrap();
    let some = |s: &str| (!s.is_empty()).then(|| s.to_string());
    Row {
        start_s,
        end_s: start_s + fields[6].parse::<f64>().unwrap_or(0.0),
        replica: some(fields[10]),
        error: some(error)
            .or_else(|| (fields[3] != "200").then(|| format!("status {}", fields[3]))),
    }
}

fn failed(rows: &[Row]) -> Vec<&Row> {
    rows.iter().filter(|r| r.error.is_some()).collect()
}

fn assert_none_failed(rows: &[Row], what: &str) {
    let bad = failed(rows);
    eprintln!(
        "chaos: {what}: {} requests, {} failed",
        rows.len(),
        bad.len()
    );
    assert!(
        bad.is_empty(),
        "{what}: {} of {} failed: {bad:#?}",
        bad.len(),
        rows.len()
    );
}

/// Every failure was on `replica`.
fn assert_only_on(rows: &[Row], replica: &str, what: &str) {
    let bad = failed(rows);
    let elsewhere: Vec<&Row> = bad
        .iter()
        .copied()
        .filter(|r| r.replica.as_deref() != Some(replica))
        .collect();
    eprintln!(
        "chaos: {what}: {} requests, {} failed, {} of them beyond the worker at fault",
        rows.len(),
        bad.len(),
        elsewhere.len()
    );
    assert!(
        elsewhere.is_empty(),
        "{what}: failures beyond {replica}: {elsewhere:#?}"
    );
}

/// Three sim workers, each under an agent, behind a gateway that admits only them.
struct AgentFleet {
    gw: Gateway,
    agents: Vec<Proc>,
    ids: Vec<String>,
    _token: tempfile::TempPath,
}

/// A replica by its port alone (its process is started by an agent).
struct Port(u16);

impl Upstream for Port {
    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.0)
    }
    fn id(&self) -> String {
        format!("sim{}", self.0)
    }
}

/// Each sim worker runs 4 sequences at once, its steps slowed tenfold (a request takes about
/// half a second), so that the load stays small enough for two cores.
const SIM: &[&str] = &["--time-scale", "10", "--max-num-seqs", "4"];

impl AgentFleet {
    async fn start(extra: &str) -> AgentFleet {
        let (port, admin_port) = (free_port(), free_port());
        let token = temp_file_with(&format!("chaos-token-{port}"), "", "chaos-token");
        let workers: Vec<Port> = (0..3).map(|_| Port(free_port())).collect();
        let upstreams: Vec<&dyn Upstream> = workers.iter().map(|w| w as &dyn Upstream).collect();
        let yaml = format!(
            "agents:\n  token_file: \"{}\"\nhealth:\n  interval_ms: 200\n  ejection_base_ms: 500\n{extra}",
            token.display()
        );
        let config = temp_file_with(
            &format!("chaos-{port}"),
            ".yaml",
            Gateway::yaml(port, admin_port, &upstreams, &yaml),
        );
        let mut cmd = kvgate();
        cmd.args(["gateway", "--config", config.to_str().unwrap()]);
        let mut gw = Gateway {
            proc: spawn(cmd, &format!("chaos-gateway-{port}")),
            port,
            admin_port,
            config,
        };
        let agents: Vec<Proc> = workers
            .iter()
            .map(|w| {
                let mut cmd = kvgate();
                cmd.args(["agent", "--gateway", &gw.admin(), "--token-file"])
                    .arg(&token)
                    .args(["--url", &w.url(), "--replica-id", &w.id()])
                    .args(["--restart-backoff-ms", "200", "--"])
                    .arg(env!("CARGO_BIN_EXE_kvgate"))
                    .args(["worker", "--backend", "sim", "--port", &w.0.to_string()])
                    .args(["--served-model-name", MODEL])
                    .args(SIM);
                spawn(cmd, &format!("chaos-agent-{}", w.id()))
            })
            .collect();
        gw.wait_ready().await.expect("port taken");
        gw.wait_until(|rs| {
            rs.iter()
                .all(|r| r["available"] == true && r["freshness"] == "fresh")
        })
        .await;
        AgentFleet {
            gw,
            agents,
            ids: workers.iter().map(Upstream::id).collect(),
            _token: token,
        }
    }

    /// The worker agent `i` supervises.
    fn worker_pid(&self, i: usize) -> u32 {
        let kids = children(self.agents[i].child.id());
        assert_eq!(kids.len(), 1, "agent {i}'s children: {kids:?}");
        kids[0]
    }
}

/// Requests a second that keep the fleet at `share` of what it serves flat out, measured
/// once, closed loop, on a fresh fleet.
async fn rate_at(share: f64) -> f64 {
    static CAPACITY: Mutex<Option<f64>> = Mutex::new(None);
    if let Some(c) = *CAPACITY.lock().unwrap() {
        return c * share;
    }
    let fleet = AgentFleet::start("").await;
    let out = temp_dir("chaos-capacity");
    let status = kvgate()
        .args([
            "bench",
            "--url",
            &fleet.gw.url(),
            "--workload",
            "random",
            "--model",
            MODEL,
        ])
        .args([
            "--concurrency",
            "24",
            "--duration-s",
            "4",
            "--requests",
            "2000",
        ])
        .args([
            "--input-mean",
            "64",
            "--output-mean",
            "16",
            "--quiet",
            "--out",
        ])
        .arg(out.path())
        .stdout(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("summary.json")).unwrap())
            .unwrap();
    let capacity = summary["requests_per_s"].as_f64().unwrap();
    eprintln!("fleet capacity: {capacity:.1} requests/s");
    *CAPACITY.lock().unwrap() = Some(capacity);
    capacity * share
}

async fn serial() -> tokio::sync::MutexGuard<'static, ()> {
    SERIAL.lock().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_reloads_under_load_fail_nothing() {
    let _one = serial().await;
    let rate = rate_at(0.7).await;
    let fleet = AgentFleet::start("").await;
    let load = Load::start(&fleet.gw.url(), rate, seconds());
    for i in 0..10 {
        load.at(0.5 + seconds() * 0.8 * f64::from(i) / 10.0).await;
        fleet.gw.proc.signal("HUP");
    }
    let rows = load.finish();
    assert_none_failed(&rows, "10 reloads");
    let metrics = fleet.gw.metrics().await;
    assert_eq!(
        metric(&metrics, "kvgate_config_reloads_total{result=\"success\"}"),
        10.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_fails_only_the_streams_it_was_serving() {
    let _one = serial().await;
    let rate = rate_at(0.7).await;
    let fleet = AgentFleet::start("").await;
    let load = Load::start(&fleet.gw.url(), rate, seconds());
    load.at(seconds() / 2.0).await;
    let killed_at = load.now_s();
    let status = std::process::Command::new("kill")
        .args(["-KILL", &fleet.worker_pid(0).to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let rows = load.finish();
    assert_only_on(&rows, &fleet.ids[0], "a worker killed");
    for r in failed(&rows) {
        // Its clock starts a little after ours: a request it started later began earlier.
        assert!(
            r.start_s <= killed_at && r.end_s + 0.5 >= killed_at - 0.5,
            "not in flight at the kill ({killed_at:.2} s): {r:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_agent_fails_nothing() {
    let _one = serial().await;
    let rate = rate_at(0.7).await;
    let mut fleet = AgentFleet::start("").await;
    let load = Load::start(&fleet.gw.url(), rate, seconds());
    load.at(seconds() / 2.0).await;
    // Its worker is told to stop with it, and finishes what it is serving.
    fleet.agents[1].signal("KILL");
    let rows = load.finish();
    assert_none_failed(&rows, "an agent killed");
    fleet.agents[1].kill();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_upgrade_under_load_fails_nothing() {
    let _one = serial().await;
    let rate = rate_at(0.7).await;
    let fleet = AgentFleet::start("shutdown_grace_ms: 30000\n").await;
    // The hand-over keeps the old process accepting for 5 s.
    let length = seconds().max(8.0);
    let load = Load::start(&fleet.gw.url(), rate, length);
    load.at(1.0).await;
    let mut cmd = kvgate();
    cmd.args([
        "gateway",
        "--upgrade",
        "--config",
        fleet.gw.config.to_str().unwrap(),
    ]);
    let _new = spawn(cmd, &format!("chaos-upgrade-{}", fleet.gw.port));
    load.at(1.5).await;
    fleet.gw.proc.signal("QUIT");
    let rows = load.finish();
    assert_none_failed(&rows, "a graceful upgrade");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_a_grace_period_lets_every_request_in_flight_finish() {
    let _one = serial().await;
    let rate = rate_at(0.7).await;
    let fleet = AgentFleet::start("shutdown_grace_ms: 30000\n").await;
    let load = Load::start(&fleet.gw.url(), rate, seconds());
    // Once the bench has stopped starting requests, with its last ones still streaming:
    // those must all finish (new connections are refused from the signal on).
    load.at(seconds() + 0.1).await;
    let stopped_at = load.now_s();
    fleet.gw.proc.signal("TERM");
    let rows = load.finish();
    let in_flight = rows.iter().filter(|r| r.end_s + 0.5 > stopped_at).count();
    assert!(
        in_flight > 0,
        "nothing was in flight at the SIGTERM: the test proves nothing"
    );
    assert_none_failed(&rows, "SIGTERM with a 30 s grace");
}

/// Three test workers behind a gateway with short timeouts; worker 0 is turned faulty
/// (`faults`, the test worker's `POST /fault`) a second into the load.
async fn faulty_worker(faults: serde_json::Value, extra: &str) -> (Vec<Row>, String) {
    let _one = serial().await;
    let workers = [
        Worker::start(&["--token-delay-ms", "20"]).await,
        Worker::start(&["--token-delay-ms", "20"]).await,
        Worker::start(&["--token-delay-ms", "20"]).await,
    ];
    let upstreams: Vec<&dyn Upstream> = workers.iter().map(|w| w as &dyn Upstream).collect();
    let gw = Gateway::start(&upstreams, extra).await;
    let load = Load::start(&gw.url(), 20.0, seconds());
    load.at(1.0).await;
    workers[0].set_faults(faults).await;
    (load.finish(), workers[0].id())
}

const SHORT_TIMEOUTS: &str = "timeouts:\n  first_byte_ms: 1500\n  idle_ms: 1000\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_worker_fails_only_requests_sent_to_it() {
    let (rows, bad) = faulty_worker(serde_json::json!({ "hang_rate": 1.0 }), SHORT_TIMEOUTS).await;
    assert_only_on(&rows, &bad, "a hung worker");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_answering_500s_fails_only_requests_sent_to_it() {
    let faults = serde_json::json!({ "error_rate": 1.0, "error_status": 500 });
    let (rows, bad) = faulty_worker(faults, SHORT_TIMEOUTS).await;
    assert_only_on(&rows, &bad, "a worker answering 500s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_answering_garbage_fails_only_requests_sent_to_it() {
    let (rows, bad) =
        faulty_worker(serde_json::json!({ "garbage_rate": 1.0 }), SHORT_TIMEOUTS).await;
    assert_only_on(&rows, &bad, "a worker answering garbage");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_dropping_streams_fails_only_its_streams() {
    let faults = serde_json::json!({ "disconnect_rate": 1.0, "disconnect_after": 3 });
    let (rows, bad) = faulty_worker(faults, SHORT_TIMEOUTS).await;
    assert_only_on(&rows, &bad, "a worker dropping streams");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_worker_fails_nothing_while_within_the_timeouts() {
    let faults = serde_json::json!({ "first_token_delay_ms": 800, "token_delay_ms": 200 });
    let (rows, _) = faulty_worker(faults, SHORT_TIMEOUTS).await;
    assert_none_failed(&rows, "a slow worker");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_trickling_its_stream_fails_only_its_streams() {
    // Upstream slowloris: a token every 1.5 s, past the 1 s idle timeout.
    let faults = serde_json::json!({ "token_delay_ms": 1500 });
    let (rows, bad) = faulty_worker(faults, SHORT_TIMEOUTS).await;
    assert_only_on(&rows, &bad, "a worker trickling its stream");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slowloris_clients_beside_the_load_fail_nothing() {
    let _one = serial().await;
    let workers = [
        Worker::start(&["--token-delay-ms", "20"]).await,
        Worker::start(&["--token-delay-ms", "20"]).await,
    ];
    let upstreams: Vec<&dyn Upstream> = workers.iter().map(|w| w as &dyn Upstream).collect();
    let gw = Gateway::start(
        &upstreams,
        "limits:\n  header_timeout_ms: 2000\n  body_timeout_ms: 2000\n",
    )
    .await;
    // 64 connections sending a header, or a body, a byte every 200 ms.
    let port = gw.port;
    let slow = std::thread::spawn(move || {
        use std::io::Write;
        let head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n";
        let mut conns: Vec<(std::net::TcpStream, usize)> = (0..64)
            .map(|i| {
                let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
                // Half trickle their header, half their body.
                let sent = if i % 2 == 0 {
                    0
                } else {
                    s.write_all(head).map(|_| head.len()).unwrap()
                };
                (s, sent)
            })
            .collect();
        let deadline = Instant::now() + Duration::from_secs_f64(seconds() + 1.0);
        let mut closed = 0;
        while Instant::now() < deadline {
            for (s, sent) in &mut conns {
                let byte = head.get(*sent).copied().unwrap_or(b'x');
                if s.write_all(&[byte]).is_ok() {
                    *sent += 1;
                }
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        for (s, _) in &conns {
            let mut buf = [0u8; 64];
            s.set_read_timeout(Some(Duration::from_millis(100)))
                .unwrap();
            // Answered (408) or closed: the read returns; still held open: it times out.
            if std::io::Read::read(&mut &*s, &mut buf).is_ok() {
                closed += 1;
            }
        }
        closed
    });
    let load = Load::start(&gw.url(), 20.0, seconds());
    let rows = load.finish();
    assert_none_failed(&rows, "slowloris clients beside the load");
    let closed = slow.join().unwrap();
    assert_eq!(
        closed, 64,
        "every slow connection was answered (408) or closed"
    );
}
