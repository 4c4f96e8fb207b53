//! `kvgate up`: a local fleet in one command — a gateway, and N workers each under an agent
//! that reports to the gateway. The fleet's tokens live in a private directory, the gateway
//! admits only this fleet's workers, every port is checked before anything starts, and a
//! signal at any moment (start-up included) stops every process: agents stop their workers
//! gracefully, and a child whose `up` dies (even by SIGKILL) stops too.

use kvgate_agent::lineage;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

pub struct UpConfig {
    pub workers: usize,
    /// `cpu` or `sim`.
    pub backend: String,
    pub port: u16,
    pub admin_port: u16,
    /// Worker `i` listens on `first_worker_port + i`.
    pub first_worker_port: u16,
    pub threads: usize,
    pub model: PathBuf,
    pub served_model_name: String,
    /// More flags for every worker (speculative decoding's).
    pub worker_args: Vec<String>,
    /// The first this many workers prefill for the rest (0: every worker serves whole).
    pub prefill_workers: usize,
}

impl UpConfig {
    /// Worker `i`'s role in a disaggregated fleet.
    fn role(&self, i: usize) -> Option<&'static str> {
        match self.prefill_workers {
            0 => None,
            k if i < k => Some("prefill"),
            _ => Some("decode"),
        }
    }
}

/// How long the fleet may take to come up (loading a model takes a few seconds).
const READY_WITHIN: Duration = Duration::from_secs(120);
/// How long children get to stop after SIGTERM before they are killed (an agent gives its
/// worker 30 s).
const STOP_GRACE: Duration = Duration::from_secs(35);

pub fn run(config: UpConfig) -> Result<(), String> {
    if config.workers == 0 || config.workers > 64 {
        return Err(format!(
            "--workers must be between 1 and 64, got {}",
            config.workers
        ));
    }
    if config.prefill_workers > 0 && config.prefill_workers >= config.workers {
        return Err(format!(
            "--prefill-workers {} leaves none of the {} workers to decode",
            config.prefill_workers, config.workers
        ));
    }
    let worker_ports = (0..config.workers)
        .map(|i| {
            u16::try_from(i)
                .ok()
                .and_then(|i| config.first_worker_port.checked_add(i))
                .ok_or("--first-worker-port plus --workers runs past port 65535")
        })
        .collect::<Result<Vec<u16>, _>>()?;
    let mut ports = vec![
        ("the gateway (--port)".to_string(), config.port),
        (
            "the admin API (--admin-port)".to_string(),
            config.admin_port,
        ),
    ];
    ports.extend(
        worker_ports
            .iter()
            .enumerate()
            .map(|(i, &p)| (format!("worker {i} (--first-worker-port + {i})"), p)),
    );
    check_free(&ports)?;

    let exe = std::env::current_exe().map_err(|e| format!("cannot find the kvgate binary: {e}"))?;
    let dir = PrivateDir::create(config.port)?;
    let agent_token = dir.write_secret("agent-token", &crate::keys::random_token()?)?;
    let admin_token = dir.write_secret("admin-token", &crate::keys::random_token()?)?;
    let gateway_config = dir.write_secret(
        "gateway.yaml",
        &gateway_yaml(&config, &worker_ports, &agent_token, &admin_token),
    )?;

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("runtime: {e}"))?;
    // Children are spawned from this (the main) thread, so that their parent-death signal
    // stays tied to the process.
    let mut children = Children(Vec::new());
    let outcome = runtime.block_on(async {
        // Signals are caught from here on: a stop during start-up stops what has started.
        let mut signals = Signals::install()?;
        children.spawn(&exe, "gateway", &["gateway", "--config", &path_arg(&gateway_config)])?;
        let admin = format!("http://127.0.0.1:{}", config.admin_port);
        for (i, &port) in worker_ports.iter().enumerate() {
            let args = agent_args(&config, &admin, &agent_token, &exe, i, port);
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            children.spawn(&exe, &format!("agent {i}"), &args)?;
        }
        tokio::select! {
            ready = wait_until_ready(&config, &admin, &admin_token, &mut children) => ready?,
            _ = signals.recv() => {
                eprintln!("kvgate up: stopped during start-up");
                return Ok(());
            }
        }
        println!(
            "\nkvgate fleet is up: {} {} worker(s) under agents, model `{}`\n  endpoint: http://127.0.0.1:{}/v1\n  replicas: curl -s -H \"Authorization: Bearer $(cat {})\" {admin}/admin/replicas\n  metrics:  curl -s http://127.0.0.1:{}/metrics\nCtrl-C stops it.",
            config.workers,
            config.backend,
            config.served_model_name,
            config.port,
            admin_token.display(),
            config.port
        );
        signals.recv().await;
        Ok::<(), String>(())
    });
    drop(children);
    outcome
}

/// Fails with the first port that is taken (a fleet already running there, say), naming it.
fn check_free(ports: &[(String, u16)]) -> Result<(), String> {
    for (name, port) in ports {
        if let Some((other, _)) = ports.iter().find(|(n, p)| p == port && n != name) {
            return Err(format!("{name} and {other} are both port {port}"));
        }
        std::net::TcpListener::bind(("127.0.0.1", *port))
            .map_err(|e| format!("port {port} for {name} is taken: {e}"))?;
    }
    Ok(())
}

/// SIGTERM and SIGINT, listened for from the moment they are installed.
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> Result<Signals, String> {
        use tokio::signal::unix::{signal, SignalKind};
        let listen = |kind| signal(kind).map_err(|e| format!("cannot listen for signals: {e}"));
        Ok(Signals {
            term: listen(SignalKind::terminate())?,
            int: listen(SignalKind::interrupt())?,
        })
    }

    async fn recv(&mut self) {
        tokio::select! {
            _ = self.term.recv() => {}
            _ = self.int.recv() => {}
        }
    }
}

/// A directory only this user can enter (0700), with a name nobody can guess, removed with
/// everything in it when dropped.
struct PrivateDir(PathBuf);

impl PrivateDir {
    fn create(port: u16) -> Result<PrivateDir, String> {
        use std::os::unix::fs::DirBuilderExt;
        let suffix = crate::keys::random_token()?;
        let path = std::env::temp_dir().join(format!("kvgate-up-{port}-{}", &suffix[..16]));
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&path)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(PrivateDir(path))
    }

    /// Writes a new file readable by this user alone (0600).
    fn write_secret(&self, name: &str, content: &str) -> Result<PathBuf, String> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let path = self.0.join(name);
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .and_then(|mut f| f.write_all(content.as_bytes()))
            .map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(path)
    }
}

impl Drop for PrivateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The fleet's processes. Dropping it stops them: SIGTERM to all, a grace period, then
/// SIGKILL to what is left.
struct Children(Vec<(String, Child)>);

impl Children {
    fn spawn(&mut self, exe: &Path, name: &str, args: &[&str]) -> Result<(), String> {
        let (key, value) = lineage::parent_env();
        let child = Command::new(exe)
            .args(args)
            .env(key, value)
            .spawn()
            .map_err(|e| format!("cannot start {name}: {e}"))?;
        self.0.push((name.to_string(), child));
        Ok(())
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        for (_, child) in &self.0 {
            lineage::terminate(child.id());
        }
        let deadline = Instant::now() + STOP_GRACE;
        for (name, child) in &mut self.0 {
            while Instant::now() < deadline && matches!(child.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(50));
            }
            if matches!(child.try_wait(), Ok(None)) {
                eprintln!("kvgate up: {name} did not stop in time; killing it");
                let _ = child.kill();
            }
            let _ = child.wait();
        }
    }
}

fn path_arg(path: &Path) -> String {
    path.display().to_string()
}

/// The gateway routes the workers' model in token mode, with the workers' own GGUF, and takes
/// reports only from this fleet's workers, by name.
fn gateway_yaml(
    config: &UpConfig,
    ports: &[u16],
    agent_token: &Path,
    admin_token: &Path,
) -> String {
    let model = std::fs::canonicalize(&config.model).unwrap_or_else(|_| config.model.clone());
    let replicas: String = ports
        .iter()
        .enumerate()
        .map(|(i, port)| {
            let labels = config
                .role(i)
                .map_or_else(String::new, |r| format!("    labels: {{{r}: \"yes\"}}\n"));
            format!("  - url: \"http://127.0.0.1:{port}\"\n    id: \"worker-{i}\"\n{labels}")
        })
        .collect();
    let pool = match config.prefill_workers {
        0 => "",
        _ => "disaggregation:\n  pools:\n    - flow: vllm\n      prefill: {prefill: \"yes\"}\n      decode: {decode: \"yes\"}\n",
    };
    format!(
        "listen: \"127.0.0.1:{}\"\nadmin_listen: \"127.0.0.1:{}\"\nadmin_token_file: \"{}\"\nreplicas:\n{replicas}{pool}agents:\n  token_file: \"{}\"\n  join: static\ntokenizers:\n  - model: \"{}\"\n    path: \"{}\"\n",
        config.port,
        config.admin_port,
        admin_token.display(),
        agent_token.display(),
        config.served_model_name,
        model.display()
    )
}

fn agent_args(
    config: &UpConfig,
    admin: &str,
    token_file: &Path,
    exe: &Path,
    i: usize,
    port: u16,
) -> Vec<String> {
    let mut args: Vec<String> = [
        "agent",
        "--gateway",
        admin,
        "--token-file",
        &path_arg(token_file),
        "--url",
        &format!("http://127.0.0.1:{port}"),
        "--replica-id",
        &format!("worker-{i}"),
        "--",
        &path_arg(exe),
        "worker",
        "--backend",
        &config.backend,
        "--port",
        &port.to_string(),
        "--model",
        &path_arg(&config.model),
        "--served-model-name",
        &config.served_model_name,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    match config.backend.as_str() {
        "cpu" => args.extend(["--threads".into(), config.threads.to_string()]),
        // One device per worker.
        "cuda" => args.extend(["--gpu".into(), i.to_string()]),
        _ => {}
    }
    if let Some(role) = config.role(i) {
        args.extend(["--role".into(), role.into()]);
    }
    args.extend(config.worker_args.iter().cloned());
    args
}

/// Waits until the gateway lists every worker as available; a process that exits meanwhile
/// is an error.
async fn wait_until_ready(
    config: &UpConfig,
    admin: &str,
    admin_token: &Path,
    children: &mut Children,
) -> Result<(), String> {
    let token = std::fs::read_to_string(admin_token)
        .map_err(|e| format!("{}: {e}", admin_token.display()))?;
    let auth = format!("Bearer {}", token.trim());
    let deadline = Instant::now() + READY_WITHIN;
    loop {
        for (name, child) in &mut children.0 {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(format!("{name} exited early ({status})"));
            }
        }
        let replicas = kvgate_agent::http::request(
            kvgate_agent::http::Method::GET,
            admin,
            "/admin/replicas",
            &[("authorization", &auth)],
            None,
            Duration::from_secs(1),
        )
        .await;
        let ready = replicas
            .ok()
            .filter(|(status, _)| *status == 200)
            .and_then(|(_, body)| serde_json::from_slice::<serde_json::Value>(&body).ok())
            .and_then(|v| {
                v["replicas"]
                    .as_array()
                    .map(|r| r.iter().filter(|r| r["available"] == true).count() >= config.workers)
            })
            .unwrap_or(false);
        if ready {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!(
                "the fleet did not come up within {} s",
                READY_WITHIN.as_secs()
            ));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
