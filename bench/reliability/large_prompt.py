#!/usr/bin/env python3
"""/health while 32 MiB prompts are refused, and the gateway's memory meanwhile.

Starts (from target/release) a test worker, a gateway routing the default model in token mode
in front of it, and a sim worker; sends each server a 32 MiB chat prompt N times, one after
another (each is refused: too long for the context), while another connection asks /health
every 10 ms; prints the /health latencies (and, for comparison, with no large prompt) and the
gateway's peak resident memory against 4x the largest allowed body (32 MiB).

Usage: bench/reliability/large_prompt.py [--rounds N]
"""
import argparse, http.client, json, os, platform, signal, socket, statistics, subprocess, sys, tempfile, threading, time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KVGATE = os.path.join(ROOT, "target", "release", "kvgate")
MODEL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
BODY_LIMIT = 32 << 20


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ok(port, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"port {port} never answered")


def health_latencies(port, stop):
    """/health round trips (ms) every 10 ms on one kept-alive connection until `stop` is set."""
    out = []
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    while not stop.is_set():
        t = time.perf_counter()
        c.request("GET", "/health")
        r = c.getresponse()
        r.read()
        out.append((time.perf_counter() - t) * 1e3)
        time.sleep(0.01)
    return out


def large_prompts(port, body, rounds):
    statuses = []
    for _ in range(rounds):
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        c.request("POST", "/v1/chat/completions", body=body, headers={"content-type": "application/json"})
        r = c.getresponse()
        r.read()
        statuses.append(r.status)
        c.close()
    return statuses


def measure(port, body, rounds):
    stop = threading.Event()
    result = {}
    poller = threading.Thread(target=lambda: result.setdefault("health", health_latencies(port, stop)))
    poller.start()
    time.sleep(0.3)
    started = time.time()
    statuses = large_prompts(port, body, rounds) if body else (time.sleep(2) or [])
    seconds = time.time() - started
    stop.set()
    poller.join()
    h = sorted(result["health"])
    pct = lambda p: h[min(len(h) - 1, int(p * len(h)))]
    return {"statuses": statuses, "seconds": seconds, "health_p50": pct(0.5), "health_p99": pct(0.99),
            "health_max": h[-1], "health_n": len(h)}


def peak_rss_mib(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main():
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="kvgate-large-prompt-")
    fault, gw, sim = free_port(), free_port(), free_port()
    conf = os.path.join(tmp, "gateway.yaml")
    open(conf, "w").write(
        f'listen: "127.0.0.1:{gw}"\nreplicas:\n  - url: "http://127.0.0.1:{fault}"\n    models: [smollm2]\n'
        f'tokenizers:\n  - model: smollm2\n    path: "{MODEL}"\n')
    procs = []
    def start(*cmd):
        procs.append(subprocess.Popen([KVGATE, *cmd], stdout=subprocess.DEVNULL,
                                      stderr=open(os.path.join(tmp, f"{len(procs)}.log"), "w"),
                                      # They stop with this script, however it ends.
                                      env={**os.environ, "KVGATE_LOG": "warn",
                                           "KVGATE_PARENT_PID": str(os.getpid())}))
        return procs[-1]
    try:
        start("fault-worker", "--port", str(fault), "--model", "smollm2")
        gateway = start("gateway", "--config", conf)
        start("worker", "--backend", "sim", "--port", str(sim), "--served-model-name", "smollm2")
        for p in (fault, gw, sim):
            wait_ok(p)
        # A body of 32 MiB less the JSON around the text.
        text = ("the quick brown fox jumps over the lazy dog " * (BODY_LIMIT // 44 + 1))[: BODY_LIMIT - 200]
        body = json.dumps({"model": "smollm2", "messages": [{"role": "user", "content": text}], "max_tokens": 4}).encode()
        assert len(body) <= BODY_LIMIT, len(body)
        rss_before = peak_rss_mib(gateway.pid)
        rows = []
        for name, port in (("gateway (token mode)", gw), ("worker (sim)", sim)):
            idle = measure(port, None, 0)
            busy = measure(port, body, args.rounds)
            rows.append((name, idle, busy))
        rss_peak = peak_rss_mib(gateway.pid)
        cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.machine())
        print(f"Large prompts against /health: {args.rounds} prompts of {len(body) / 2**20:.1f} MiB each, one after another; "
              f"/health every 10 ms on another connection. {cpu}, {os.cpu_count()} cores; kvgate release build.\n")
        print("| server | prompt answers | time for all | /health p50 | p99 | max (idle max) |")
        print("|---|---|---|---|---|---|")
        for name, idle, busy in rows:
            print(f"| {name} | {sorted(set(busy['statuses']))} | {busy['seconds']:.2f} s | {busy['health_p50']:.2f} ms | "
                  f"{busy['health_p99']:.2f} ms | {busy['health_max']:.2f} ms ({idle['health_max']:.2f} ms) |")
        print(f"\nGateway peak resident memory: {rss_peak:.0f} MiB (before the prompts: {rss_before:.0f} MiB; "
              f"4x the largest allowed body: {4 * BODY_LIMIT / 2**20:.0f} MiB).")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    main()
