"""Servers a benchmark starts: each in a session of its own, stopped by its PID, also when the
script is interrupted or fails."""
import json, os, signal, socket, subprocess, sys, tempfile, time, urllib.request

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def prepare(name, out):
    """Before a run: SIGTERM ends it as an exception would (its servers are stopped), the
    release binary is built, `out` exists. Returns a fresh folder for the servers' logs."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    subprocess.run(["cargo", "build", "--release", "--bin", "kvgate"], cwd=ROOT, check=True)
    os.makedirs(out, exist_ok=True)
    return tempfile.mkdtemp(prefix=f"kvgate-{name}-")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One server process in a session of its own, stopped by its PID."""

    def __init__(self, name, cmd, port, logs):
        self.port, self.name = port, name
        self.log = open(os.path.join(logs, f"{name}.log"), "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT,
                                     start_new_session=True)
        try:
            self.wait_healthy()
        except BaseException:
            # Interrupted or failed while starting: the process goes with the script.
            self.stop()
            raise

    def wait_healthy(self):
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited: see {self.log.name}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1).read()
                return
            except Exception:
                time.sleep(0.3)
        raise SystemExit(f"{self.name} never became healthy")

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def post(port, path, body, timeout=600):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def stream(port, path, body):
    """The JSON chunks of a streamed (server-sent events) answer, as they arrive."""
    with post(port, path, body) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])
