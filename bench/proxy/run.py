#!/usr/bin/env python3
"""Proxy overhead: added latency (1 connection) and throughput (64 connections) of kvgate,
nginx, SGLang's router and vLLM's router in front of one nginx fixed-JSON backend, measured
side by side with wrk on loopback. Peers come from bench/peers/install (a venv outside the
repository). Prints a markdown table with the labels of the run.

Usage: bench/proxy/run.py [--seconds N] [--rounds N]
"""
import argparse, os, platform, re, shutil, signal, socket, statistics, subprocess, sys, tempfile, time, urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.join(ROOT, "bench", "proxy")
PEERS = os.environ.get("KVGATE_PEERS", "/tmp/kvgate-peers")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            req = urllib.request.Request(url, data=open(os.path.join(HERE, "body.json"), "rb").read(),
                                         headers={"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=1) as r:
                if r.status == 200:
                    return
        except Exception:
            time.sleep(0.2)
    raise SystemExit(f"{url} never answered")


def wrk(url, threads, conns, seconds):
    out = subprocess.run(["wrk", f"-t{threads}", f"-c{conns}", f"-d{seconds}s", "--latency",
                          "-s", os.path.join(HERE, "post.lua"), url],
                         capture_output=True, text=True, check=True).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    def pct(p):
        m = re.search(rf"^\s+{p}%\s+([\d.]+)(us|ms|s)\s*$", out, re.M)
        v, unit = float(m.group(1)), m.group(2)
        return v * {"us": 1, "ms": 1e3, "s": 1e6}[unit]
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if errors or "Socket errors" in out:
        print(out, file=sys.stderr)
    return rps, pct(50), pct(99)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="kvgate-proxy-bench-")
    backend, nginx_proxy, kvgate, sglang, vllm = (free_port() for _ in range(5))
    conf = open(os.path.join(HERE, "nginx.conf.in")).read()
    conf = conf.replace("@DIR@", tmp).replace("@BACKEND@", str(backend)).replace("@PROXY@", str(nginx_proxy))
    open(os.path.join(tmp, "nginx.conf"), "w").write(conf)
    with open(os.path.join(HERE, "body.json"), "w") as f:
        f.write(re.search(r"wrk.body = '(.*)'", open(os.path.join(HERE, "post.lua")).read()).group(1))
    gw_conf = os.path.join(tmp, "kvgate.yaml")
    open(gw_conf, "w").write(
        f'listen: "127.0.0.1:{kvgate}"\nthreads: 1\nreplicas:\n  - url: "http://127.0.0.1:{backend}"\n    models: [bench]\n')
    procs = []
    def start(cmd, **kw):
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, f"{len(procs)}.log"), "w"), **kw)
        procs.append(p)
    try:
        start([shutil.which("nginx") or "/usr/sbin/nginx", "-c", os.path.join(tmp, "nginx.conf")])
        start([os.path.join(ROOT, "target", "release", "kvgate"), "gateway", "--config", gw_conf],
              env={**os.environ, "KVGATE_LOG": "warn"})
        py = os.path.join(PEERS, "bin", "python")
        router_flags = ["--host", "127.0.0.1", "--worker-urls", f"http://127.0.0.1:{backend}"]
        start([py, "-m", "sglang_router.launch_router", "--port", str(sglang), "--policy", "cache_aware",
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())] + router_flags)
        start([os.path.join(PEERS, "bin", "vllm-router"), "--port", str(vllm), "--policy", "consistent_hash",
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())] + router_flags)
        targets = [("direct (nginx fixed JSON)", backend), ("nginx proxy", nginx_proxy), ("kvgate", kvgate),
                   ("SGLang router 0.3.2 cache_aware", sglang), ("vLLM router 0.1.17 consistent_hash", vllm)]
        for _, port in targets:
            wait_http(f"http://127.0.0.1:{port}/v1/chat/completions")
        results = {name: {"rps": [], "p50": [], "p99": []} for name, _ in targets}
        for _ in range(args.rounds):
            for name, port in targets:
                url = f"http://127.0.0.1:{port}/v1/chat/completions"
                _, p50, p99 = wrk(url, 1, 1, args.seconds)
                rps, _, _ = wrk(url, 2, 64, args.seconds)
                r = results[name]
                r["rps"].append(rps); r["p50"].append(p50); r["p99"].append(p99)
        med = {n: {k: statistics.median(v) for k, v in r.items()} for n, r in results.items()}
        direct = med[targets[0][0]]
        version = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        print(f"Labels: host {platform.node()} ({os.cpu_count()} cores, shared by wrk, proxy and backend), "
              f"kvgate {version} (release, threads: 1, jemalloc), nginx worker_processes 1, "
              f"wrk -t1 -c1 (latency) and -t2 -c64 (throughput), {args.seconds}s x {args.rounds} rounds, medians.\n")
        print("| proxy | req/s (64 conns) | p50 µs (1 conn) | p99 µs (1 conn) | added p50 µs | added p99 µs |")
        print("|---|---:|---:|---:|---:|---:|")
        for name, _ in targets:
            m = med[name]
            print(f"| {name} | {m['rps']:.0f} | {m['p50']:.0f} | {m['p99']:.0f} | "
                  f"{m['p50'] - direct['p50']:.0f} | {m['p99'] - direct['p99']:.0f} |")
        kv, sg, ng = med["kvgate"], med[targets[3][0]], med["nginx proxy"]
        added = lambda m: max(m["p50"] - direct["p50"], 1e-9)
        print(f"\nkvgate vs SGLang router: added p50 {added(kv) / added(sg):.2f}x, throughput {kv['rps'] / sg['rps']:.2f}x")
        print(f"kvgate vs nginx: added p50 {added(kv) / added(ng):.2f}x, throughput {kv['rps'] / ng['rps']:.2f}x")
    finally:
        for p in procs:
            p.send_signal(signal.SIGINT)
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    main()
