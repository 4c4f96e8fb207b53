#!/usr/bin/env python3
"""Several kvgate gateways in front of one real sim fleet, with and without the decision
exchange (`peers:`): the same workers as run.py (4, H200 / Llama-3.1-8B profile, --time-scale
4), token mode, every agent reporting to every gateway, and `kvgate bench` sending its requests
to the gateways in turn (`--url` repeated). Configurations: `one` (one gateway), `N` (N
gateways that share nothing), `N-peers` (N gateways that push each other their decisions).

Writes OUT/<workload>@<rate>/<config>/ (the bench's results and rounds.json) and prints, per
cell, each configuration's TTFT P50/P90, cached ratio, requests per replica and how many
replicas each prefix group reached, and its P90 over one gateway's (medians over the rounds).

Usage: bench/routing/gateways.py [--workloads one-system-prompt,shared-prefix] [--rate 20]
                                 [--gateways 2] [--rounds 3] [--out DIR]
"""
import argparse, csv, json, os, signal, statistics, subprocess, sys, tempfile

import run


def gateway_yaml(port, admin, workers, token_file, peer_admins):
    """run.py's kvgate gateway (token mode, agents), with `peers:` when it has some."""
    y = run.gateway_yaml(port, admin, workers, "kvgate", token_file)
    if peer_admins:
        urls = ", ".join(f'"{a}"' for a in peer_admins)
        y += f'peers:\n  urls: [{urls}]\n  token_file: "{token_file}"\n'
    return y


def start_gateways(procs, count, exchange, workers, logs, token_file):
    """`count` gateways (exchanging decisions or not) and one agent per worker reporting to all
    of them; returns their URLs and the processes to stop after."""
    ports = [(run.free_port(), run.free_port()) for _ in range(count)]
    admins = [f"http://127.0.0.1:{a}" for _, a in ports]
    started = []
    for i, (port, admin) in enumerate(ports):
        peers = [a for j, a in enumerate(admins) if j != i] if exchange else []
        path = os.path.join(logs, f"gateway-{i}.yaml")
        with open(path, "w") as f:
            f.write(gateway_yaml(port, admin, workers, token_file, peers))
        started.append(procs.start(f"gateway-{i}", [run.KVGATE, "gateway", "--config", path]))
    for port, _ in ports:
        run.wait_ok(f"http://127.0.0.1:{port}/health")
    to_all = [arg for a in admins for arg in ("--gateway", a)]
    for i, w in enumerate(workers):
        started.append(procs.start(f"agent-{i}", [run.KVGATE, "agent", *to_all, "--token-file",
                                                  token_file, "--url", w, "--replica-id", f"w{i}"]))
    for admin in admins:
        run.wait_fresh(admin)
    return [f"http://127.0.0.1:{p}" for p, _ in ports], started


def replicas_per_group(path):
    groups = {}
    with open(os.path.join(path, "requests.csv")) as f:
        for row in csv.DictReader(f):
            if row["group"] and row["replica"]:
                groups.setdefault(row["group"], set()).add(row["replica"])
    return statistics.mean(len(r) for r in groups.values()) if groups else 0.0


def run_one(procs, workload, rate, config, workers, out_root, logs, token_file, time_scale):
    for w in workers:
        run.post(f"{w}/reset_prefix_cache")
    count = 1 if config == "one" else int(config.split("-")[0])
    urls, started = start_gateways(procs, count, config.endswith("-peers"), workers, logs,
                                   token_file)
    out = os.path.join(out_root, f"{workload}@{rate}", config)
    cmd = [run.KVGATE, "bench", *[a for u in urls for a in ("--url", u)], "--model", run.MODEL,
           "--out", out, "--quiet", "--label", f"config={config}",
           "--label", f"sim_time_scale={time_scale}", *run.at_load(run.WORKLOADS[workload], rate)]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=run.ROOT)
    if res.returncode != 0:
        print(res.stdout, res.stderr, file=sys.stderr)
        raise SystemExit(f"bench failed for {workload}@{rate}/{config}")
    run.wait_idle(workers)
    for p in started:
        procs.stop(p)
    with open(os.path.join(out, "summary.json")) as f:
        s = json.load(f)
    s["replicas_per_group"] = replicas_per_group(out)
    return s


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="one-system-prompt,shared-prefix")
    ap.add_argument("--rate", type=float, default=20.0)
    ap.add_argument("--gateways", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--time-scale", type=float, default=4.0)
    ap.add_argument("--out", default="/tmp/kvgate-gateways")
    args = ap.parse_args()
    # Killed, stop every process started (they run in sessions of their own).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    subprocess.run(["cargo", "build", "--release", "--bin", "kvgate"], cwd=run.ROOT, check=True)
    logs = tempfile.mkdtemp(prefix="kvgate-gateways-")
    token_file = os.path.join(logs, "token")
    with open(token_file, "w") as f:
        f.write("gateways-experiment-token\n")
    procs = run.Procs(logs)
    configs = ["one", str(args.gateways), f"{args.gateways}-peers"]
    print(f"4 sim workers (time scale {args.time_scale}); kvgate "
          f"{subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=run.ROOT, capture_output=True, text=True).stdout.strip()}; "
          f"{args.rounds} round(s) at {args.rate} req/s; logs in {logs}\n")
    try:
        for workload in args.workloads.split(","):
            workers = run.start_workers(procs, 4, args.time_scale,
                                        run.KV_BLOCKS.get(workload, 1536))
            results = {c: [] for c in configs}
            for r in range(args.rounds):
                for c in configs:
                    s = run_one(procs, workload, args.rate, c, workers, args.out, logs,
                                token_file, args.time_scale)
                    print(f"  {workload}/{c} round {r + 1}: TTFT p90 {s['ttft_s']['p90'] * 1000:.0f} ms",
                          file=sys.stderr)
                    results[c].append(s)
            procs.stop_all()
            for c, rounds in results.items():
                with open(os.path.join(args.out, f"{workload}@{args.rate}", c, "rounds.json"), "w") as f:
                    json.dump(rounds, f, indent=2)
            med = lambda c, f: statistics.median(f(s) for s in results[c])
            one = med("one", lambda s: s["ttft_s"]["p90"])
            print(f"#### {workload} at {args.rate} req/s\n")
            print("| gateways | TTFT p50 ms | TTFT p90 ms | P90 over one gateway's | cached ratio | "
                  "requests per replica | replicas per group |")
            print("|---|---:|---:|---:|---:|---|---:|")
            for c in configs:
                per = "/".join(str(n) for n in sorted(results[c][-1]["requests_per_replica"].values()))
                print(f"| {c} | {med(c, lambda s: s['ttft_s']['p50']) * 1000:.0f} | "
                      f"{med(c, lambda s: s['ttft_s']['p90']) * 1000:.0f} | "
                      f"{med(c, lambda s: s['ttft_s']['p90']) / one:.2f} | "
                      f"{med(c, lambda s: s['cached_token_ratio']):.3f} | {per} | "
                      f"{med(c, lambda s: s['replicas_per_group']):.2f} |")
            print()
    finally:
        procs.stop_all()


if __name__ == "__main__":
    main()
