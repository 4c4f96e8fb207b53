//! Shared harness for the end-to-end tests: starts the real `kvgate` binary's processes on
//! free loopback ports and talks HTTP to them.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod process;

pub use process::*;
use std::process::Command;
use std::time::{Duration, Instant};

pub const MODEL: &str = "test-model";

/// The fields of a `policy:` section that turn the bounded-load caps on (the default has them
/// off), for the tests of the caps, the imbalance guard and bounded traffic; a test adds the
/// rest of its section after them.
pub const BOUNDED_LOAD: &str = "  weights: {prefix: 3.0, ring: 1.0}
  load_factor: 1.25
  cached_load_bonus: 0.5
  imbalance_factor: 3.0
  traffic_bound: 1.0
  recompute_penalty: 0
";

/// A test worker on a free port.
pub struct Worker {
    pub proc: Proc,
    pub port: u16,
}

impl Worker {
    pub async fn start(extra: &[&str]) -> Worker {
        let (proc, port) = start_on_free_port("worker", |port| Self::command(port, extra)).await;
        Worker { proc, port }
    }

    /// A worker on `port`, which must be free.
    pub async fn start_on(port: u16, extra: &[&str]) -> Worker {
        let mut proc = spawn(Self::command(port, extra), &format!("worker-{port}"));
        let health = format!("http://127.0.0.1:{port}/health");
        proc.wait_healthy(&health).await.expect("port taken");
        Worker { proc, port }
    }

    fn command(port: u16, extra: &[&str]) -> Command {
        let mut cmd = kvgate();
        cmd.args(["fault-worker", "--port", &port.to_string()])
            .args(["--id", &format!("w{port}")])
            .args(extra);
        cmd
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn id(&self) -> String {
        format!("w{}", self.port)
    }

    pub async fn set_faults(&self, faults: serde_json::Value) {
        let r = client()
            .post(format!("{}/fault", self.url()))
            .json(&faults)
            .send()
            .await
            .unwrap();
        assert!(
            r.status().is_success(),
            "set faults: {}",
            r.text().await.unwrap()
        );
    }

    pub async fn stats(&self) -> serde_json::Value {
        get_json(&format!("{}/stats", self.url())).await
    }
}

/// A `kvgate worker --backend sim` (or another backend) on a free port, serving [`MODEL`].
pub struct SimWorker {
    pub proc: Proc,
    pub port: u16,
}

impl SimWorker {
    pub async fn start(extra: &[&str]) -> SimWorker {
        SimWorker::start_backend("sim", extra).await
    }

    /// A worker on the real model: `kvgate worker --backend cpu` on the default GGUF.
    pub async fn start_cpu(extra: &[&str]) -> SimWorker {
        SimWorker::start_backend("cpu", extra).await
    }

    async fn start_backend(backend: &str, extra: &[&str]) -> SimWorker {
        let (proc, port) = start_on_free_port(backend, |port| {
            let mut cmd = kvgate();
            cmd.args(["worker", "--backend", backend, "--port", &port.to_string()])
                .args(["--served-model-name", MODEL])
                .args(extra);
            cmd
        })
        .await;
        SimWorker { proc, port }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub async fn get(&self, path: &str) -> serde_json::Value {
        get_json(&format!("{}{path}", self.url())).await
    }

    pub async fn metrics(&self) -> String {
        client()
            .get(format!("{}/metrics", self.url()))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }
}

impl Upstream for SimWorker {
    fn url(&self) -> String {
        SimWorker::url(self)
    }
    fn id(&self) -> String {
        format!("sim{}", self.port)
    }
}

impl Upstream for Worker {
    fn url(&self) -> String {
        Worker::url(self)
    }
    fn id(&self) -> String {
        Worker::id(self)
    }
}

/// Anything the gateway can front.
pub trait Upstream {
    fn url(&self) -> String;
    fn id(&self) -> String;
}

pub struct Gateway {
    pub proc: Proc,
    pub port: u16,
    pub admin_port: u16,
    pub config: tempfile::TempPath,
}

impl Gateway {
    /// Starts a gateway over `workers` on free ports; `extra` is appended to the YAML
    /// (top-level keys).
    pub async fn start(workers: &[&dyn Upstream], extra: &str) -> Gateway {
        on_free_ports("gateway", async || {
            let (port, admin_port) = (free_port(), free_port());
            let yaml = Self::yaml(port, admin_port, workers, extra);
            Self::launch(port, admin_port, yaml).await
        })
        .await
    }

    /// [`Gateway::start`] on the given client and admin ports.
    pub async fn start_at(
        port: u16,
        admin_port: u16,
        workers: &[&dyn Upstream],
        extra: &str,
    ) -> Gateway {
        let yaml = Self::yaml(port, admin_port, workers, extra);
        Self::start_config(port, admin_port, yaml).await
    }

    /// A gateway on `yaml` as written (listening on `port`, its admin API on `admin_port`).
    pub async fn start_config(port: u16, admin_port: u16, yaml: String) -> Gateway {
        let taken = "a port of the gateway's was taken";
        Self::launch(port, admin_port, yaml).await.expect(taken)
    }

    async fn launch(port: u16, admin_port: u16, yaml: String) -> Result<Gateway, PortTaken> {
        let config = temp_file_with(&format!("gateway-{port}"), ".yaml", &yaml);
        let mut cmd = kvgate();
        cmd.args(["gateway", "--config", config.to_str().unwrap()]);
        let mut gw = Gateway {
            proc: spawn(cmd, &format!("gateway-{port}")),
            port,
            admin_port,
            config,
        };
        gw.wait_ready().await?;
        gw.wait_until(|replicas| replicas.iter().all(|r| r["models"].is_array()))
            .await;
        Ok(gw)
    }

    pub fn yaml(port: u16, admin_port: u16, workers: &[&dyn Upstream], extra: &str) -> String {
        let mut yaml =
            format!("listen: \"127.0.0.1:{port}\"\nadmin_listen: \"127.0.0.1:{admin_port}\"\n");
        if !extra.contains("health:") {
            yaml.push_str("health:\n  interval_ms: 200\n  ejection_base_ms: 500\n");
        }
        yaml.push_str("replicas:\n");
        for w in workers {
            yaml.push_str(&format!(
                "  - url: \"{}\"\n    id: \"{}\"\n",
                w.url(),
                w.id()
            ));
        }
        yaml.push_str(extra);
        yaml
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn admin(&self) -> String {
        format!("http://127.0.0.1:{}", self.admin_port)
    }

    /// Waits until both its listeners answer: each is its own service, ready in its own time
    /// (the proxy's can answer before the admin API's is bound).
    pub async fn wait_ready(&mut self) -> Result<(), PortTaken> {
        let (proxy, admin) = (self.url(), self.admin());
        self.proc.wait_healthy(&format!("{proxy}/health")).await?;
        self.proc.wait_healthy(&format!("{admin}/health")).await
    }

    /// How the gateway would route `body` (`POST /admin/explain`), which must answer 200.
    pub async fn explain(&self, body: &serde_json::Value) -> serde_json::Value {
        let r = client()
            .post(format!("{}/admin/explain", self.admin()))
            .json(body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        r.json().await.unwrap()
    }

    pub async fn replicas(&self) -> Vec<serde_json::Value> {
        let v = get_json(&format!("{}/admin/replicas", self.admin())).await;
        v["replicas"].as_array().unwrap().clone()
    }

    /// Polls the admin API until `check` holds (10 s at most).
    pub async fn wait_until(&self, check: impl Fn(&[serde_json::Value]) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let replicas = self.replicas().await;
            if check(&replicas) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "condition not reached; replicas: {replicas:#?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub async fn metrics(&self) -> String {
        client()
            .get(format!("{}/metrics", self.url()))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap()
}

/// POST `body` to `url` + `path`: the status and the JSON body (null when it is not JSON).
pub async fn post(url: &str, path: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
    post_with(&client(), url, path, body).await
}

/// [`post`] through a client of the caller's (another timeout).
pub async fn post_with(
    c: &reqwest::Client,
    url: &str,
    path: &str,
    body: &serde_json::Value,
) -> (u16, serde_json::Value) {
    let r = c
        .post(format!("{url}{path}"))
        .json(body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or_default())
}

/// GET `url` and parse its JSON body.
pub async fn get_json(url: &str) -> serde_json::Value {
    client()
        .get(url)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

pub fn chat(content: &str, stream: bool) -> serde_json::Value {
    serde_json::json!({
        "model": MODEL,
        "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": content}],
        "stream": stream,
        "max_tokens": 64,
    })
}

pub fn completion(prompt: &str, stream: bool) -> serde_json::Value {
    serde_json::json!({ "model": MODEL, "prompt": prompt, "stream": stream, "max_tokens": 64 })
}

/// The outcome of one request as a client sees it.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub text: String,
    pub replica: Option<String>,
    /// A streamed `{"error": ...}` event arrived.
    pub stream_error: bool,
    pub done: bool,
}

/// Sends a request and collects the answer text (streamed or not).
pub async fn send(
    client: &reqwest::Client,
    url: &str,
    path: &str,
    body: &serde_json::Value,
) -> Answer {
    let stream = body["stream"].as_bool().unwrap_or(false);
    let mut resp = client
        .post(format!("{url}{path}"))
        .header("x-kvgate-debug", "1")
        .json(body)
        .send()
        .await
        .unwrap_or_else(|e| panic!("request failed: {e}"));
    let status = resp.status().as_u16();
    let replica = resp
        .headers()
        .get("x-kvgate-replica")
        .map(|v| v.to_str().unwrap().to_string());
    if !stream || status != 200 {
        let v: serde_json::Value = resp.json().await.unwrap_or_default();
        let text = v["choices"][0]["message"]["content"]
            .as_str()
            .or(v["choices"][0]["text"].as_str())
            .unwrap_or("");
        return Answer {
            status,
            text: text.to_string(),
            replica,
            stream_error: v.get("error").is_some(),
            done: true,
        };
    }
    let mut raw = Vec::new();
    loop {
        match resp.chunk().await {
            Ok(Some(c)) => raw.extend_from_slice(&c),
            Ok(None) => break,
            Err(_) => break,
        }
    }
    let (text, stream_error, done) = parse_sse(&String::from_utf8_lossy(&raw));
    Answer {
        status,
        text,
        replica,
        stream_error,
        done,
    }
}

/// Text content, whether an error event arrived, and whether `[DONE]` arrived.
pub fn parse_sse(raw: &str) -> (String, bool, bool) {
    let mut text = String::new();
    let (mut error, mut done) = (false, false);
    for data in kvgate_protocol::sse::SseParser::default().push(raw.as_bytes()) {
        if data == "[DONE]" {
            done = true;
            continue;
        }
        // Data that is no JSON (a garbled stream) carries no text.
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&data) else {
            continue;
        };
        if v.get("error").is_some() {
            error = true;
        }
        if let Some(t) = v["choices"][0]["delta"]["content"]
            .as_str()
            .or(v["choices"][0]["text"].as_str())
        {
            text.push_str(t);
        }
    }
    (text, error, done)
}

/// The value of one series (`name{labels}`) in a Prometheus text exposition (0 when absent).
pub fn metric(metrics: &str, series: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// `kvgate agent` attached to `upstream`, reporting to `gw` as replica `upstream.id()`.
pub fn attach_agent(
    gw: &Gateway,
    token: &std::path::Path,
    upstream: &dyn Upstream,
    extra: &[&str],
) -> Proc {
    let mut cmd = kvgate();
    cmd.args(["agent", "--gateway", &gw.admin(), "--token-file"])
        .arg(token)
        .args(["--url", &upstream.url(), "--replica-id", &upstream.id()])
        .args(extra);
    spawn(cmd, &format!("agent-{}", upstream.id()))
}

/// The live child processes of `pid`.
pub fn children(pid: u32) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|p| {
            std::fs::read_to_string(format!("/proc/{p}/stat"))
                .ok()
                .and_then(|s| {
                    let after = &s[s.rfind(')')? + 2..];
                    after.split_whitespace().nth(1)?.parse::<u32>().ok()
                })
                == Some(pid)
        })
        .collect()
}

/// `len` token ids of a synthetic prompt, different for each `seed`: ordinary vocabulary, no
/// special tokens, nothing shared between seeds.
pub fn prompt_ids(seed: u32, len: u32) -> Vec<u32> {
    (0..len)
        .map(|i| 200 + (i * 31 + seed * 977) % 20_000)
        .collect()
}

/// The prompt tokens a response's `usage` counts as cached.
pub fn cached_tokens(response: &serde_json::Value) -> u64 {
    response["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap()
}

/// A CPU worker on one thread with a 64 MiB KV cache and a 512-token context: room for a
/// few short prompts, quick to start.
pub const CPU_SMALL_CONTEXT: [&str; 6] = [
    "--threads",
    "1",
    "--kv-cache-mib",
    "64",
    "--max-model-len",
    "512",
];

/// Everything the server sends on `s` until it closes the connection (or `s`'s read timeout
/// passes).
pub fn read_to_close(s: &mut std::net::TcpStream) -> String {
    use std::io::Read;
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

/// One figure of each candidate in `gw`'s explanation of `body`, by name, best first.
pub async fn by_replica(
    gw: &Gateway,
    body: &serde_json::Value,
    figure: &str,
) -> Vec<(String, f64)> {
    let (status, e) = post(&gw.admin(), "/admin/explain", body).await;
    assert_eq!(status, 200, "{e}");
    e["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let name = c["replica"].as_str().unwrap().to_string();
            (name, c["score"][figure].as_f64().unwrap())
        })
        .collect()
}

/// Waits until `gw` explains `body` with a candidate whose `figure` passes `ok`.
pub async fn until_explained(
    gw: &Gateway,
    body: &serde_json::Value,
    figure: &str,
    what: &str,
    ok: impl Fn(&[(String, f64)]) -> bool,
) -> Vec<(String, f64)> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let now = by_replica(gw, body, figure).await;
        if ok(&now) {
            return now;
        }
        assert!(Instant::now() < deadline, "never {what}: {now:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
