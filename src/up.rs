//! `kvgate up`: a local fleet in one command — a gateway, and N workers each under an agent
//! that reports to the gateway (the workers join the fleet by reporting). Ctrl-C or SIGTERM
//! stops everything: agents stop their workers gracefully.

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
}

/// Children killed (and reaped) when dropped, so that an early error leaves nothing behind.
struct Children(Vec<(String, Child)>);

impl Drop for Children {
    fn drop(&mut self) {
        for (_, child) in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

pub fn run(config: UpConfig) -> Result<(), String> {
    if config.workers == 0 || config.workers > 64 {
        return Err(format!(
            "--workers must be between 1 and 64, got {}",
            config.workers
        ));
    }
    let exe = std::env::current_exe().map_err(|e| format!("cannot find the kvgate binary: {e}"))?;
    let dir = std::env::temp_dir().join(format!("kvgate-up-{}", config.port));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let token_file = dir.join("agent-token");
    std::fs::write(&token_file, token()).map_err(|e| format!("{}: {e}", token_file.display()))?;
    let gateway_config = dir.join("gateway.yaml");
    std::fs::write(&gateway_config, gateway_yaml(&config, &token_file))
        .map_err(|e| format!("{}: {e}", gateway_config.display()))?;

    let mut children = Children(Vec::new());
    let spawn = |name: String, args: Vec<String>, children: &mut Children| {
        Command::new(&exe)
            .args(&args)
            .spawn()
            .map(|c| children.0.push((name.clone(), c)))
            .map_err(|e| format!("cannot start {name}: {e}"))
    };
    spawn(
        "gateway".into(),
        vec![
            "gateway".into(),
            "--config".into(),
            gateway_config.display().to_string(),
        ],
        &mut children,
    )?;
    let admin = format!("http://127.0.0.1:{}", config.admin_port);
    for i in 0..config.workers {
        let port = u16::try_from(i)
            .ok()
            .and_then(|i| config.first_worker_port.checked_add(i))
            .ok_or("--first-worker-port plus --workers runs past port 65535")?;
        spawn(
            format!("agent {i}"),
            agent_args(&config, &admin, &token_file, &exe, i, port),
            &mut children,
        )?;
    }

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("runtime: {e}"))?;
    runtime.block_on(async {
        wait_until_ready(&config, &admin, &mut children).await?;
        println!(
            "\nkvgate fleet is up: {} {} worker(s) under agents, model `{}`\n  endpoint: http://127.0.0.1:{}/v1\n  replicas: curl -s {admin}/admin/replicas\n  metrics:  curl -s http://127.0.0.1:{}/metrics\nCtrl-C stops it.",
            config.workers, config.backend, config.served_model_name, config.port, config.port
        );
        kvgate_agent::shutdown_signal().await;
        Ok::<(), String>(())
    })?;
    stop(&mut children);
    Ok(())
}

/// The gateway routes the workers' model in token mode, with the workers' own GGUF.
fn gateway_yaml(config: &UpConfig, token_file: &Path) -> String {
    let model = std::fs::canonicalize(&config.model).unwrap_or_else(|_| config.model.clone());
    format!(
        "listen: \"127.0.0.1:{}\"\nadmin_listen: \"127.0.0.1:{}\"\nreplicas: []\nagents:\n  token_file: \"{}\"\n  join: open\ntokenizers:\n  - model: \"{}\"\n    path: \"{}\"\n",
        config.port,
        config.admin_port,
        token_file.display(),
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
        &token_file.display().to_string(),
        "--url",
        &format!("http://127.0.0.1:{port}"),
        "--replica-id",
        &format!("worker-{i}"),
        "--",
        &exe.display().to_string(),
        "worker",
        "--backend",
        &config.backend,
        "--port",
        &port.to_string(),
        "--model",
        &config.model.display().to_string(),
        "--served-model-name",
        &config.served_model_name,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if config.backend == "cpu" {
        args.extend(["--threads".into(), config.threads.to_string()]);
    }
    args
}

/// Waits until the gateway lists every worker as available (a process that exits meanwhile is
/// an error; loading the model takes a few seconds).
async fn wait_until_ready(
    config: &UpConfig,
    admin: &str,
    children: &mut Children,
) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        for (name, child) in &mut children.0 {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(format!("{name} exited early ({status})"));
            }
        }
        let ready = kvgate_agent::http::get_text(admin, "/admin/replicas", Duration::from_secs(1))
            .await
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
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
            return Err("the fleet did not come up within 120 s".into());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// SIGTERM to every child (agents stop their workers), then waits; the `Drop` of `Children`
/// kills whatever is left.
fn stop(children: &mut Children) {
    for (_, child) in &children.0 {
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
    }
    let deadline = Instant::now() + Duration::from_secs(15);
    for (name, child) in &mut children.0 {
        while Instant::now() < deadline {
            match child.try_wait() {
                Ok(Some(_)) | Err(_) => break,
                Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
        if matches!(child.try_wait(), Ok(None)) {
            eprintln!("kvgate up: {name} did not stop in time; killing it");
        }
    }
}

/// A fresh token for this fleet's agents (not a secret beyond this machine: it only keeps
/// stray reports out).
fn token() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.write_u32(std::process::id());
    format!("{:016x}", h.finish())
}
