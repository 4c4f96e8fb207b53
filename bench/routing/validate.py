#!/usr/bin/env python3
"""`kvgate sim` against the real sim fleet: the routing experiment's workloads in the simulator
with run.py's own arguments (workload, load, warm-up, KV blocks, context length, 4 replicas, the
agents' 100 ms reports) and its workers' time scale (`--worker-time-scale`, so that every time,
the gateways' clocks included, is in the real fleet's units), beside the results run.py wrote.

What the simulator leaves out is everything outside the engines: HTTP, tokenization, the
router's own work, and the timing noise of real processes. (And the sim worker's answers are random tokens, which do
not survive detokenizing and tokenizing again: `--answers-retokenize`.) `--probe` measures it once per
configuration on the real fleet: one request at a time (a shared-prefix probe, 30 requests),
each request's real TTFT less its simulated one. The validation then gives each
configuration's simulation that time outside the engines: `--gateway-delay-ms` its P10, and
`--gateway-jitter-ms` its P90 less its P10, drawn per request; the simulated figures are
medians over `--seeds` jitter seeds (the workload's seed stays run.py's).

Usage: bench/routing/run.py --workloads shared-prefix,multi-turn,mooncake \\
           --configs kvgate,vllm-round-robin,sglang-cache-aware --rounds 5 --out REAL
       bench/routing/validate.py --real REAL --probe
       bench/routing/validate.py --real REAL [--seeds 1,...,15]   (jitter seeds)
       bench/routing/validate.py --real REAL --loads R1,R2   (run.py --loads cells, WORKLOAD@R)
Prints one markdown table: per workload (or cell) and config, real against simulated P50 and
P90 TTFT, cached ratio and requests per replica (medians over run.py's rounds, and over the
simulator's seeds), each with the simulated figure's deviation; then one of kvgate's P90 over
each peer's, real against simulated, per cell.
"""
import argparse, csv, json, os, signal, statistics, subprocess, sys, tempfile

import run

PROFILE = os.path.join(run.ROOT, "config", "profiles", "h200-llama-3.1-8b-bf16.yaml")
# run.py's configurations → the simulator's policy of the same algorithm.
POLICIES = {
    "kvgate": "kvgate",
    "kvgate-cache-first": "cache-first",
    "round-robin": "round-robin",
    "vllm-round-robin": "round-robin",
    "sglang-cache-aware": "sglang-cache-aware",
    "vllm-consistent-hash": "vllm-consistent-hash",
}
PROBE = ["--workload", "shared-prefix", "--groups", "2", "--prompts-per-group", "20",
         "--system-len", "1024", "--question-len", "128", "--output-len", "16",
         "--concurrency", "1", "--requests", "30", "--warmup", "4"]


def simulate(args, policy, out, time_scale, jitter_seed, outside=None, blocks=1536):
    outside = outside or {}
    cmd = [run.KVGATE, "sim", "--replicas", "4", "--profile", PROFILE,
           "--num-blocks", str(blocks), "--max-model-len", str(min(8192, blocks * 16)),
           "--worker-time-scale", str(time_scale),
           "--gateway-delay-ms", str(outside.get("delay_ms", 0.0)),
           "--gateway-jitter-ms", str(outside.get("jitter_ms", 0.0)),
           "--jitter-seed", str(jitter_seed), "--answers-retokenize", "--quiet", "--out", out, *args, "--policy", policy]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=run.ROOT)
    if res.returncode != 0:
        sys.exit(f"kvgate sim failed: {' '.join(cmd)}\n{res.stderr}")
    return load(os.path.join(out, policy, "summary.json"))


def load(path):
    with open(path) as f:
        return json.load(f)


def probe(real_root, configs, time_scale, out):
    """Real P50 TTFT one request at a time through each configuration, less the simulated."""
    logs = tempfile.mkdtemp(prefix="kvgate-probe-")
    token_file = os.path.join(logs, "token")
    with open(token_file, "w") as f:
        f.write("routing-experiment-token\n")
    procs = run.Procs(logs)
    delays = {}
    try:
        workers = run.start_workers(procs, 4, time_scale, 1536)
        for config in configs:
            for w in workers:
                run.post(f"{w}/reset_prefix_cache")
            url, started = run.start_router(procs, config, workers, logs, token_file)
            real_out = os.path.join(out, "probe-real", config)
            subprocess.run([run.KVGATE, "bench", "--url", url, "--model", run.MODEL, "--quiet",
                            "--out", real_out, *PROBE], check=True, capture_output=True, cwd=run.ROOT)
            for p in started:
                procs.stop(p)
            sim_out = os.path.join(out, "probe-sim")
            simulate(PROBE, POLICIES[config], sim_out, time_scale, 0)
            ttfts = lambda path: [float(r["ttft_s"]) * 1e3 for r in csv.DictReader(open(path))
                                  if r["warmup"] == "false"]
            real = ttfts(os.path.join(real_out, "requests.csv"))
            sim = ttfts(os.path.join(sim_out, POLICIES[config], "requests.csv"))
            outside = sorted(a - b for a, b in zip(real, sim))
            q = lambda p: outside[int(p * (len(outside) - 1))]
            delays[config] = {"p10_ms": q(0.1), "p50_ms": q(0.5), "p90_ms": q(0.9),
                              "delay_ms": max(0.0, q(0.1)), "jitter_ms": max(0.0, q(0.9) - q(0.1))}
            print(f"probe {config}: outside the engines P10 {q(0.1):.1f}, P50 {q(0.5):.1f}, "
                  f"P90 {q(0.9):.1f} ms", file=sys.stderr)
    finally:
        procs.stop_all()
    with open(os.path.join(real_root, "probe.json"), "w") as f:
        json.dump(delays, f, indent=2)


def real_rounds(path):
    rounds = os.path.join(path, "rounds.json")
    return load(rounds) if os.path.exists(rounds) else [load(os.path.join(path, "summary.json"))]


def median(summaries, f):
    return statistics.median(f(s) for s in summaries)


def deviation(sim, real):
    return f"{(sim / real - 1) * 100:+.0f} %" if real else "n/a"


def per_replica(summary):
    # run.py counts each worker's requests from its metrics, warm-up included.
    counts = summary.get("per_worker_requests") or list(summary["requests_per_replica"].values())
    return "/".join(str(n) for n in sorted(counts))


def sim_per_replica(out, policy):
    """Requests per replica in a simulation, warm-up included (as run.py counts them)."""
    counts = {}
    with open(os.path.join(out, policy, "requests.csv")) as f:
        for row in csv.DictReader(f):
            counts[row["replica"]] = counts.get(row["replica"], 0) + 1
    return "/".join(str(n) for n in sorted(counts.values()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--real", required=True, help="run.py --out of the real fleet's runs")
    ap.add_argument("--out", default="/tmp/kvgate-sim-validation")
    ap.add_argument("--workloads", default="shared-prefix,multi-turn,mooncake")
    ap.add_argument("--time-scale", type=float, default=4.0, help="the real workers' --time-scale")
    ap.add_argument("--seeds", default=",".join(str(s) for s in range(1, 16)))
    ap.add_argument("--loads", default=None,
                    help="the cells of run.py --loads: comma-separated rates (speed-ups for mooncake)")
    ap.add_argument("--probe", action="store_true",
                    help="measure each configuration's time outside the engines on the real fleet")
    args = ap.parse_args()
    # Killed, stop every process started (they run in sessions of their own).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    subprocess.run(["cargo", "build", "--release", "--bin", "kvgate"], cwd=run.ROOT, check=True)
    workloads = args.workloads.split(",")
    loads = [float(l) for l in args.loads.split(",")] if args.loads else [None]
    cells = [(w, l, w if l is None else f"{w}@{l}") for w in workloads for l in loads]
    configs = [c for c in POLICIES
               if any(os.path.isdir(os.path.join(args.real, cell, c)) for _, _, cell in cells)]
    if args.probe:
        probe(args.real, configs, args.time_scale, args.out)
        return
    probe_path = os.path.join(args.real, "probe.json")
    delays = load(probe_path) if os.path.exists(probe_path) else {}
    seeds = [int(s) for s in args.seeds.split(",")]
    print("| workload | config (simulated as; outside the engines, ms: delay + jitter) | TTFT P50 ms real / sim | dev | "
          "TTFT P90 ms real / sim | dev | cached ratio real / sim | dev | "
          "requests per replica real / sim |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    p90s = {}
    for workload, at, cell in cells:
        for c in configs:
            path = os.path.join(args.real, cell, c)
            if not os.path.isdir(path):
                continue
            real = real_rounds(path)
            outside = delays.get(c, {})
            out = os.path.join(args.out, cell, c)
            bench_args = run.at_load(run.WORKLOADS[workload], at)
            sims = [simulate(bench_args, POLICIES[c], os.path.join(out, f"seed-{s}"),
                             args.time_scale, s, outside, run.KV_BLOCKS.get(workload, 1536))
                    for s in seeds]
            q = lambda p: lambda s: s["ttft_s"][p] * 1e3
            cached = lambda s: s["cached_token_ratio"]
            row = [(median(real, f), median(sims, f)) for f in (q("p50"), q("p90"), cached)]
            (p50, p90, ratio) = row
            p90s[(cell, c)] = p90
            delay = f"{outside.get('delay_ms', 0):.1f} + {outside.get('jitter_ms', 0):.1f}"
            print(f"| {cell} | {c} ({POLICIES[c]}; {delay}) | {p50[0]:.0f} / {p50[1]:.0f} | "
                  f"{deviation(p50[1], p50[0])} | {p90[0]:.0f} / {p90[1]:.0f} | {deviation(p90[1], p90[0])} | "
                  f"{ratio[0]:.3f} / {ratio[1]:.3f} | {deviation(ratio[1], ratio[0])} | "
                  f"{per_replica(real[-1])} / {sim_per_replica(os.path.join(out, f'seed-{seeds[0]}'), POLICIES[c])} |")
    peers = [c for c in configs if POLICIES[c] not in ("kvgate", "cache-first")]
    print()
    print("| cell | " + " | ".join(f"kvgate P90 ÷ {p}'s, real / sim | dev" for p in peers) + " |")
    print("|---|" + "---:|---:|" * len(peers))
    for _, _, cell in cells:
        if (cell, "kvgate") not in p90s:
            continue
        k = p90s[(cell, "kvgate")]
        parts = []
        for p in peers:
            if (cell, p) in p90s:
                o = p90s[(cell, p)]
                real, sim = k[0] / o[0], k[1] / o[1]
                parts.append(f"{real:.2f} / {sim:.2f} | {deviation(sim, real)}")
            else:
                parts.append("n/a | n/a")
        print(f"| {cell} | " + " | ".join(parts) + " |")

if __name__ == "__main__":
    main()
