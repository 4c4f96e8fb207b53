//! The test processes: the `kvgate` binary started on free loopback ports, waited for and
//! stopped with the test; and the temporary files they are given, removed with it.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A child process killed when dropped.
pub struct Proc {
    pub child: Child,
    pub name: String,
    /// Where its stderr goes; removed with it.
    pub log: tempfile::TempPath,
}

impl Proc {
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Waits for it to exit (30 s at most).
    pub fn exits(&mut self) -> std::process::ExitStatus {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < deadline, "{} did not exit", self.name);
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits until `url` answers 2xx (20 s at most). A process that exits first fails the
    /// test with its log, unless its port was taken before it could listen: then
    /// `Err(PortTaken)`, for the caller to start it again on another port.
    pub async fn wait_healthy(&mut self, url: &str) -> Result<(), PortTaken> {
        let deadline = Instant::now() + Duration::from_secs(20);
        let c = probe_client();
        while Instant::now() < deadline {
            if answers_ok(&c, url).await {
                return Ok(());
            }
            if let Some(status) = self.child.try_wait().unwrap() {
                let log = std::fs::read_to_string(&self.log).unwrap_or_default();
                if log.contains("Address already in use") {
                    return Err(PortTaken);
                }
                panic!(
                    "{} exited ({status}) before {url} answered:\n{log}",
                    self.name
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        panic!("{url} never became healthy; {}'s log:\n{log}", self.name);
    }

    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([&format!("-{signal}"), &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "kill -{signal} {}", self.name);
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
        // The log goes with the process; a failed test shows the end of it first.
        if std::thread::panicking() {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            eprintln!(
                "--- the end of {}'s log ---\n{}",
                self.name,
                tail.join("\n")
            );
        }
    }
}

/// A port free now and never handed out before in this test process: the system may give the
/// same free port twice, and a gateway started on two equal ports would answer its admin API on
/// its proxy listener (or another test's process would take the port first).
pub fn free_port() -> u16 {
    static HANDED_OUT: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut handed_out = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        if !handed_out.contains(&port) {
            handed_out.push(port);
            return port;
        }
    }
}

/// `n` consecutive free ports (for commands that number their ports from a first one); tries
/// again where a neighbour is taken.
pub fn free_ports(n: u16) -> u16 {
    (0..100)
        .map(|_| free_port())
        .find(|&first| {
            first.checked_add(n).is_some()
                && (1..n).all(|i| TcpListener::bind(("127.0.0.1", first + i)).is_ok())
        })
        .expect("no run of free ports found in 100 tries")
}

/// The `kvgate` binary, run from the repository root (where the default model and the
/// profiles are).
pub fn kvgate() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvgate"));
    cmd.current_dir(env!("CARGO_MANIFEST_DIR"));
    cmd
}

pub fn spawn(mut cmd: Command, name: &str) -> Proc {
    let (file, log) = temp_file(name, ".log").into_parts();
    cmd.stdout(Stdio::null())
        .stderr(file)
        .env("KVGATE_LOG", "info,pingora_core=warn");
    Proc {
        child: cmd.spawn().unwrap(),
        name: name.to_string(),
        log,
    }
}

/// A new empty file in the system's temporary directory, removed when dropped (a test leaves
/// nothing behind).
pub fn temp_file(name: &str, suffix: &str) -> tempfile::NamedTempFile {
    tempfile::Builder::new()
        .prefix(&format!("kvgate-test-{name}-"))
        .suffix(suffix)
        .tempfile()
        .unwrap()
}

/// A file holding `content` in the system's temporary directory, removed when dropped.
pub fn temp_file_with(name: &str, suffix: &str, content: impl AsRef<[u8]>) -> tempfile::TempPath {
    let path = temp_file(name, suffix).into_temp_path();
    std::fs::write(&path, content).unwrap();
    path
}

/// A new directory in the system's temporary directory, removed with what is in it when
/// dropped.
pub fn temp_dir(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("kvgate-test-{name}-"))
        .tempdir()
        .unwrap()
}

/// A server's port was bound by another process before the server could listen on it.
#[derive(Debug)]
pub struct PortTaken;

/// Runs `start` (which picks its own free ports) until no port of its was taken first: a
/// free port can be bound by another process before the server listens on it (a listener's or
/// an outgoing connection's ephemeral port is drawn from the same range).
pub async fn on_free_ports<T>(
    what: &str,
    mut start: impl AsyncFnMut() -> Result<T, PortTaken>,
) -> T {
    for _ in 0..5 {
        if let Ok(started) = start().await {
            return started;
        }
    }
    panic!("{what}: five times in a row a free port was taken before it could listen");
}

/// Starts the server `command(port)` builds on a free port and waits for its `/health` there.
pub async fn start_on_free_port(name: &str, command: impl Fn(u16) -> Command) -> (Proc, u16) {
    on_free_ports(name, async || {
        let port = free_port();
        let mut proc = spawn(command(port), &format!("{name}-{port}"));
        proc.wait_healthy(&format!("http://127.0.0.1:{port}/health"))
            .await?;
        Ok((proc, port))
    })
    .await
}

/// Waits until `url` answers 2xx (20 s at most).
pub async fn wait_ok(url: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    let c = probe_client();
    while Instant::now() < deadline {
        if answers_ok(&c, url).await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{url} never became healthy");
}

fn probe_client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_millis(500))
        .build()
        .unwrap()
}

async fn answers_ok(c: &reqwest::Client, url: &str) -> bool {
    c.get(url)
        .send()
        .await
        .is_ok_and(|r| r.status().is_success())
}
