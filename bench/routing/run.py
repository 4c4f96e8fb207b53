#!/usr/bin/env python3
"""The routing experiment: the same sim workers (H200 / Llama-3.1-8B profile, slowed by
--time-scale so that the fleet, the router and the load generator share 2 cores) behind each
routing configuration in turn, on the same workloads, measured with `kvgate bench`.

Configurations: round-robin (SGLang's router), least-load, consistent hash only and
approximate prefix (kvgate gateway in text mode with those weights), kvgate's default and its
cache-first preset (token mode, agents relaying KV events), SGLang's router `cache_aware`,
vLLM's router `consistent_hash`, and vllm-round-robin (round-robin through vLLM's router,
see PEER_ROUTERS). Workloads: shared-prefix groups, multi-turn chat, the Mooncake synthetic
trace (prompts scaled down 8x). Every worker's prefix cache is emptied between runs.

Writes bench/routing/results/<workload>/<config>/ (the bench's summary.json, requests.csv,
plots of the last round, and rounds.json with every round's summary) and prints one markdown
table per workload, with the run's labels.

Usage: bench/routing/run.py [--workloads shared-prefix,shared-prefix-small-kv,multi-turn,mooncake]
                            [--configs NAME,...] [--workers 4] [--time-scale 4] [--rounds 3]
                            [--loads R1,R2,...] [--out DIR]
Config names beyond the fixed ones: `kvgate+FIELD=VALUE[+...]` is the default preset with
`policy:` fields set (e.g. `kvgate+load_factor=1.5`).
Each configuration runs `--rounds` times (rounds interleaved across configurations); the tables
give each metric's median over the rounds, and the TTFT P90 of every round.
`--loads` sweeps the offered load instead of the fixed one: Poisson rates (req/s) for the
synthetic workloads, replay speed-ups for the trace; one table of TTFT P90 (P50) per load.
Peers: bench/peers/install (SGLang and vLLM routers in a venv outside the repository).
"""
import argparse, json, os, platform, re, signal, socket, subprocess, sys, tempfile, time, urllib.request

import floor

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KVGATE = os.path.join(ROOT, "target", "release", "kvgate")
PEERS = os.environ.get("KVGATE_PEERS", "/tmp/kvgate-peers")
MODEL = "llama-3.1-8b-sim"
GGUF = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
TRACE = "/work/shared/traces/synthetic_trace.jsonl"
if not os.path.exists(TRACE):
    TRACE = os.path.join(ROOT, "..", "shared", "traces", "synthetic_trace.jsonl")

# Offered load, chosen near the knee of the cache-blind configurations on this machine (stated
# in BENCHMARKS.md with the results). The first wave of requests (one per concurrency slot) is
# warm-up: it meets empty caches in every configuration alike, and at fixed concurrency it is a
# burst of cold prefills that sets the tail of a short run. Its rows stay in requests.csv,
# marked; the ideal cached ratio counts warm-up prefixes as seen.
WORKLOADS = {
    "shared-prefix": ["--workload", "shared-prefix", "--groups", "16", "--prompts-per-group", "18",
                      "--system-len", "1024", "--question-len", "128", "--output-len", "64",
                      "--concurrency", "32", "--requests", "288", "--warmup", "32"],
    "multi-turn": ["--workload", "multi-turn", "--turns", "5", "--system-len", "256",
                   "--turn-len", "128", "--output-len", "64", "--concurrency", "16",
                   "--requests", "216", "--warmup", "16"],
    # The trace's prefix reuse builds up over time (ideal 5 % over its first 300 requests,
    # 21 % over 1,200 after 100 of warm-up, 65 % over all 3,993): replay 1,200 twice as fast
    # as recorded (7.5 req/s; the fleet's ceiling on this workload is ~10.5 req/s).
    "mooncake": ["--workload", f"mooncake:{TRACE}", "--block-tokens", "64", "--requests", "1200",
                 "--warmup", "100", "--time-scale", "2"],
}
# The same shared-prefix traffic with KV for a quarter of its system prompts per replica (all
# of them across the fleet): the regime prefix-aware routing is for.
WORKLOADS["shared-prefix-small-kv"] = WORKLOADS["shared-prefix"]
# Every prompt under one system prompt: where a purely cache-aware router sends everything to
# the first replica that holds it, and the imbalance guard must spread the load.
WORKLOADS["one-system-prompt"] = ["--workload", "shared-prefix", "--groups", "1",
                                  "--prompts-per-group", "288", "--system-len", "1024",
                                  "--question-len", "128", "--output-len", "64",
                                  "--concurrency", "32", "--requests", "288", "--warmup", "32"]
# KV blocks (16 tokens) per worker: small for the synthetic workloads; for the trace, sized like
# an H200 serving an 8B model (~0.5M tokens of its ~1M), since its working set (1.5M tokens
# over 1,200 requests) is what it tests.
# The trace's first 600 requests (50 of warm-up), for a cell that fits beside others in one
# session: 80 s a run where the 1,200 take 160.
WORKLOADS["mooncake-600"] = ["--workload", f"mooncake:{TRACE}", "--block-tokens", "64",
                             "--requests", "600", "--warmup", "50", "--time-scale", "2"]
KV_BLOCKS = {"shared-prefix-small-kv": 640, "mooncake": 32768, "mooncake-600": 32768}
# The peers' routers: config → (router, its --policy). On this fleet SGLang's router adds ~25 ms
# to every TTFT even at concurrency 1 and vLLM's does not (BENCHMARKS.md); vllm-round-robin is
# SGLang's round-robin without that cost. (vLLM's router has a `cache_aware` too, with SGLang's
# defaults, but it does not route as SGLang's does: it is not offered here.)
PEER_ROUTERS = {
    "round-robin": ("sglang", "round_robin"),
    "sglang-cache-aware": ("sglang", "cache_aware"),
    "vllm-consistent-hash": ("vllm", "consistent_hash"),
    "vllm-round-robin": ("vllm", "round_robin"),
}
CONFIGS = ["round-robin", "least-load", "consistent-hash", "approx-prefix", "kvgate",
           "kvgate-cache-first", "sglang-cache-aware", "vllm-consistent-hash"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url, timeout=2):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def post(url, timeout=5):
    req = urllib.request.Request(url, data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read().decode()


def wait_ok(url, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            get(url, 1)
            return
        except Exception:
            time.sleep(0.2)
    raise SystemExit(f"{url} never answered")


class Procs:
    def __init__(self, logs):
        self.procs, self.logs = [], logs

    def start(self, name, cmd):
        log = open(os.path.join(self.logs, f"{name}.log"), "w")
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                             env={**os.environ, "KVGATE_LOG": "warn"}, start_new_session=True)
        self.procs.append(p)
        return p

    def stop(self, p):
        try:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(timeout=10)
        except Exception:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except Exception:
                pass
        if p in self.procs:
            self.procs.remove(p)

    def stop_all(self):
        for p in list(self.procs):
            self.stop(p)


def worker_requests(url):
    m = re.search(r"^kvgate_worker_requests_total (\d+)", get(f"{url}/metrics"), re.M)
    return int(m.group(1)) if m else 0


def wait_idle(workers, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        busy = 0
        for w in workers:
            e = json.loads(get(f"{w}/stats"))["engine"]
            busy += e["running"] + e["waiting"]
        if busy == 0:
            return
        time.sleep(0.2)


def gateway_yaml(port, admin, workers, config, token_file):
    y = [f'listen: "127.0.0.1:{port}"', f'admin_listen: "127.0.0.1:{admin}"',
         "health: {interval_ms: 500}", "debug_headers: true", "replicas:"]
    y += [f'  - {{url: "{w}", id: w{i}}}' for i, w in enumerate(workers)]
    weights = {
        "least-load": "{prefix: 0, ring: 0, load: 1, prefill: 0, fresh: 0, session: 0, kv: 0, adapter: 0}",
        "consistent-hash": "{prefix: 0, ring: 1, load: 0, prefill: 0, fresh: 0, session: 0, kv: 0, adapter: 0}",
    }.get(config)
    if weights:
        # The textbook baselines: the plain 1.25 load bound, no allowance for held prefixes,
        # no imbalance guard.
        y += ["policy:", f"  weights: {weights}", "  cached_load_bonus: 0", "  imbalance_factor: 0"]
    if config == "kvgate-cache-first":
        y += ["policy: {preset: cache-first}"]
    # `kvgate+load_factor=1.5+kv_saturation=0.95`: the default preset with policy fields set.
    overrides = config.split("+")[1:]
    if config.startswith("kvgate+") and overrides:
        y += ["policy: {" + ", ".join(o.replace("=", ": ") for o in overrides) + "}"]
    if config.startswith("kvgate"):
        y += ["agents:", f'  token_file: "{token_file}"',
              "tokenizers:", f'  - {{model: "{MODEL}", path: "{GGUF}", block_size: 16}}']
    return "\n".join(y) + "\n"


def start_router(procs, config, workers, logs, token_file):
    """Starts the router for `config`; returns its URL and the processes to stop after."""
    port = free_port()
    started = []
    if config in PEER_ROUTERS:
        router, policy = PEER_ROUTERS[config]
        if router == "vllm":
            cmd = [os.path.join(PEERS, "bin", "vllm-router")]
        else:
            cmd = [os.path.join(PEERS, "bin", "python"), "-m", "sglang_router.launch_router"]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
                "--policy", policy, "--prometheus-host", "127.0.0.1",
                "--prometheus-port", str(free_port())]
        started.append(procs.start(f"router-{config}", cmd))
        wait_ok(f"http://127.0.0.1:{port}/v1/models", 90)
        return f"http://127.0.0.1:{port}", started
    admin = free_port()
    path = os.path.join(logs, f"gateway-{config}.yaml")
    with open(path, "w") as f:
        f.write(gateway_yaml(port, admin, workers, config, token_file))
    started.append(procs.start(f"gateway-{config}", [KVGATE, "gateway", "--config", path]))
    wait_ok(f"http://127.0.0.1:{port}/health")
    if config.startswith("kvgate"):
        for i, w in enumerate(workers):
            started.append(procs.start(f"agent-{i}", [
                KVGATE, "agent", "--gateway", f"http://127.0.0.1:{admin}", "--token-file",
                token_file, "--url", w, "--replica-id", f"w{i}"]))
        wait_fresh(f"http://127.0.0.1:{admin}")
    return f"http://127.0.0.1:{port}", started


def wait_fresh(admin, timeout=30):
    """Until every replica of the gateway at `admin` has a fresh agent report."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        reps = json.loads(get(f"{admin}/admin/replicas"))["replicas"]
        if all(r.get("freshness") == "fresh" for r in reps):
            return
        time.sleep(0.2)


def at_load(args, load):
    """A workload's bench arguments at another offered load: a Poisson rate (req/s) in place of
    the fixed concurrency, or for the trace a replay speed-up in place of its own."""
    if load is None:
        return args
    flag = "--concurrency" if "--concurrency" in args else "--time-scale"
    value = str(load)
    i = args.index(flag)
    return args[:i] + (["--rate", value] if flag == "--concurrency" else [flag, value]) + args[i + 2:]


def run_one(procs, workload, config, workers, out_root, logs, token_file, time_scale, load=None):
    for w in workers:
        post(f"{w}/reset_prefix_cache")
    url, started = start_router(procs, config, workers, logs, token_file)
    before = [worker_requests(w) for w in workers]
    cell = workload if load is None else f"{workload}@{load}"
    out = os.path.join(out_root, cell, config)
    # vLLM's consistent_hash keys on X-User-ID (among other headers): each request's prefix
    # group goes there; kvgate and SGLang's router ignore that header. kvgate answers
    # `x-kvgate-debug` with its scores, which requests.csv keeps per request.
    cmd = [KVGATE, "bench", "--url", url, "--model", MODEL, "--out", out, "--quiet",
           "--group-header", "x-user-id", "--header", "x-kvgate-debug: 1",
           "--label", f"config={config}", "--label", f"sim_time_scale={time_scale}",
           *at_load(WORKLOADS[workload], load)]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if res.returncode != 0:
        print(res.stdout, res.stderr, file=sys.stderr)
        raise SystemExit(f"bench failed for {cell}/{config}")
    wait_idle(workers)
    per_worker = [worker_requests(w) - b for w, b in zip(workers, before)]
    for p in started:
        procs.stop(p)
    with open(os.path.join(out, "summary.json")) as f:
        s = json.load(f)
    s["per_worker_requests"] = per_worker
    if workload.startswith("mooncake"):
        s["ttft_floor_s"] = floor.summarize(out, time_scale, trace=TRACE)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(s, f, indent=2)
    return s


def median(values):
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def imbalance(per):
    return max(per) / min(per) if min(per) > 0 else float("inf")


def table(workload, results):
    """One row per configuration: each metric's median over its rounds (`results`: config ->
    list of summaries), the median of the rounds' spreads, and the P90 of each round. For the
    trace, also the P90 of each request's TTFT over its no-queue floor (floor.py)."""
    floors = all("ttft_floor_s" in s for rounds in results.values() for s in rounds)
    extra = " TTFT over floor p90 |" if floors else ""
    lines = [f"#### {workload}", "",
             "| config | TTFT p50 | TTFT p90 | TTFT p99 | ITL p99 | e2e p99 | req/s | out tok/s | cached ratio | max/min per replica |" + extra + " TTFT p90 per round |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if floors else "") + "---|"]
    ideal = None
    for config, rounds in results.items():
        med = lambda f: median([f(s) for s in rounds])
        ms = lambda k, p: f"{med(lambda s: s[k][p]) * 1000:.0f}"
        spread = med(lambda s: imbalance(s["per_worker_requests"]))
        p90s = ", ".join(f"{s['ttft_s']['p90'] * 1000:.0f}" for s in rounds)
        over = f" {med(lambda s: s['ttft_floor_s']['over_floor']['p90']) * 1000:.0f} |" if floors else ""
        lines.append(f"| {config} | {ms('ttft_s','p50')} | {ms('ttft_s','p90')} | {ms('ttft_s','p99')} | "
                     f"{ms('itl_s','p99')} | {ms('e2e_s','p99')} | {med(lambda s: s['requests_per_s']):.2f} | "
                     f"{med(lambda s: s['output_tokens_per_s']):.0f} | {med(lambda s: s['cached_token_ratio']):.3f} | "
                     f"{spread:.2f} |{over} {p90s} |")
        ideal = rounds[0].get("ideal_cached_token_ratio") or ideal
    lines.append("")
    lines.append(f"Medians over {len(next(iter(results.values())))} round(s); times in ms (simulated H200 time x the time scale). Ideal single-replica "
                 f"cached-token ratio: {ideal:.3f}." if ideal is not None else
                 "Times in ms (simulated H200 time x the time scale), medians over the rounds.")
    if floors:
        f = next(iter(results.values()))[0]["ttft_floor_s"]["floor"]
        lines.append(f"No-queue floor (each request alone on an idle worker, ideal reuse; "
                     f"bench/routing/floor.py): TTFT p50 {f['p50'] * 1000:.0f}, "
                     f"p90 {f['p90'] * 1000:.0f}, p99 {f['p99'] * 1000:.0f}.")
    return "\n".join(lines)


def sweep_table(workload, loads, results):
    """Offered load against TTFT: one row per configuration, one column per load (`results`:
    (config, load) -> list of summaries), each cell the median P90 (and P50) over the rounds."""
    unit = "x recorded rate" if workload.startswith("mooncake") else "req/s, Poisson"
    lines = [f"#### {workload}: TTFT P90 (P50) in ms by offered load ({unit})", "",
             "| config | " + " | ".join(str(l) for l in loads) + " |",
             "|---|" + "---:|" * len(loads)]
    configs = dict.fromkeys(c for c, _ in results)
    for config in configs:
        cells = []
        for load in loads:
            rounds = results[(config, load)]
            p = lambda q: median([s["ttft_s"][q] for s in rounds]) * 1000
            cells.append(f"{p('p90'):.0f} ({p('p50'):.0f})")
        lines.append(f"| {config} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(f"Medians over {len(next(iter(results.values())))} round(s); simulated H200 "
                 "time x the time scale. Each cell's full results are in "
                 f"bench/routing/results/{workload}@LOAD/.")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--time-scale", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=3,
                    help="runs per configuration (single runs vary a lot on a 2-core machine)")
    ap.add_argument("--loads", default=None,
                    help="sweep offered load instead: comma-separated Poisson rates in req/s "
                         "(replay speed-ups for mooncake), one sweep table per workload")
    ap.add_argument("--num-blocks", type=int, default=1536,
                    help="KV blocks (16 tokens) per worker for workloads without their own in KV_BLOCKS")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "routing", "results"),
                    help="results root: OUT/<workload>/<config>/")
    args = ap.parse_args()
    # Killed, stop every process started (they run in sessions of their own).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    subprocess.run(["cargo", "build", "--release", "--bin", "kvgate"], cwd=ROOT, check=True)
    logs = tempfile.mkdtemp(prefix="kvgate-routing-")
    out_root = args.out
    token_file = os.path.join(logs, "token")
    with open(token_file, "w") as f:
        f.write("routing-experiment-token\n")
    procs = Procs(logs)
    print(f"labels: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
          f"{args.workers} sim workers (config/profiles/h200-llama-3.1-8b-bf16.yaml, "
          f"time scale {args.time_scale}); "
          f"kvgate {subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=ROOT, capture_output=True, text=True).stdout.strip()}; "
          f"sglang-router 0.3.2, vllm-router 0.1.17; {args.rounds} round(s); logs in {logs}\n")
    try:
        for workload in args.workloads.split(","):
            blocks = KV_BLOCKS.get(workload, args.num_blocks)
            workers = start_workers(procs, args.workers, args.time_scale, blocks)
            loads = [float(l) for l in args.loads.split(",")] if args.loads else [None]
            results = {(c, l): [] for l in loads for c in args.configs.split(",")}
            for r in range(args.rounds):
                for (config, load), rounds in results.items():
                    t0 = time.time()
                    s = run_one(procs, workload, config, workers, out_root, logs, token_file,
                                args.time_scale, load)
                    at = "" if load is None else f"@{load}"
                    print(f"  {workload}{at}/{config} round {r + 1}: {time.time() - t0:.0f} s, "
                          f"TTFT p90 {s['ttft_s']['p90'] * 1000:.0f} ms", file=sys.stderr)
                    rounds.append(s)
            procs.stop_all()
            # Each round's summary beside the last round's results.
            for (config, load), rounds in results.items():
                cell = workload if load is None else f"{workload}@{load}"
                with open(os.path.join(out_root, cell, config, "rounds.json"), "w") as f:
                    json.dump(rounds, f, indent=2)
            print(f"{blocks} KV blocks of 16 tokens per worker.\n")
            if args.loads:
                print(sweep_table(workload, loads, results))
            else:
                print(table(workload, {c: rounds for (c, _), rounds in results.items()}))
            print()
    finally:
        procs.stop_all()


def start_workers(procs, count, time_scale, blocks):
    workers = []
    for i in range(count):
        port = free_port()
        procs.start(f"worker-{i}", [KVGATE, "worker", "--backend", "sim", "--port", str(port),
                                     "--served-model-name", MODEL, "--time-scale", str(time_scale),
                                     "--num-blocks", str(blocks),
                                     # A worker refuses a context its KV cannot hold.
                                     "--max-model-len", str(min(8192, blocks * 16))])
        workers.append(f"http://127.0.0.1:{port}")
    for w in workers:
        wait_ok(f"{w}/health")
    return workers


if __name__ == "__main__":
    main()
