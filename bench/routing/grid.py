#!/usr/bin/env python3
"""The routing grid: every policy on the same arrivals over many workload shapes, in
`kvgate sim` (H200 / Llama-3.1-8B profile), at 0.3, 0.6, 0.9 and 1.1 of each shape's capacity.

Shapes: one system prompt; shared-prefix with 4-256 groups and 256- to 8k-token system prompts;
multi-turn with 2, 8 and 20 turns; long documents (8k and 32k tokens, each asked about three
times); the Mooncake conversation and tool-and-agent traces; the Azure code and conversation
traces; scarce KV (room for about four prompts per replica); 16 and 64 replicas; 4 and 8
gateways. A shape's capacity is kvgate's throughput in a closed loop of 32 jobs per replica;
open-loop shapes are then sent at a Poisson rate of that fraction, traces sped up to it.

Each cell runs kvgate's default, its presets, the peers' algorithms and the oracle over
--seeds seeds (arrivals and prompts; a trace is one arrival sequence, so its seeds draw 0.5 ms
of gateway jitter per request instead). Per cell: kvgate's P90 TTFT over the best peer's, over
SGLang's cache_aware, round-robin's and the oracle's; its cached ratio over the best peer's;
its per-replica spread (most over fewest requests) over the best peer's. Each ratio is the
median over the seeds, with its noise (half the range over the seeds) and, for the P90 and
cached ratios over the best peer's, the interval that holds the median with 90 % confidence
(distribution-free: the seeds' order statistics; with too few seeds for 90 %, their range and
what it covers). The goals' summary counts the cells whose whole interval misses a goal.

Writes OUT/cells/CELL/seedN/ (kvgate sim's results; a cell already there is not run again),
OUT/grid.json, OUT/grid.md (the table) and OUT/heat_*.svg (one heat map per ratio: shapes by
load), and prints the table and the goals' summary.

Usage: bench/routing/grid.py [--out DIR] [--seeds 3] [--jobs 2] [--only SUBSTRING]
                             [--oracle-replays 16] [--exchange-ms MS [--exchange-seeds 15]
                             [--exchange-only GRID_JSON]] [--try POLICY.yaml ...]
--exchange-ms MS also runs kvgate on the many-gateway shapes with the gateways telling each
other their decisions and prefill backlogs (`kvgate sim --gateway-exchange-ms`), and through
one gateway, over --exchange-seeds seeds, and adds a table of it (OUT/exchange/); with
--exchange-only only that table is made (OUT/exchange.md), from an earlier run's grid.json.
--try runs kvgate policy files on every cell too (OUT/cells/CELL/seedN/try/NAME/) and adds them
to the table of each preset's P90 over the best peer's across the grid, beside the default's.
"""
import argparse, concurrent.futures, csv, datetime, json, math, os, shutil, statistics
import subprocess, sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KVGATE = os.path.join(ROOT, "target", "release", "kvgate")
TRACES = os.path.join(ROOT, "..", "shared", "traces")
LOADS = [0.3, 0.6, 0.9, 1.1]
PEERS = ["round-robin", "least-load", "sglang-cache-aware", "vllm-consistent-hash", "llm-d",
         "dynamo"]
PRESETS = ["balanced", "cache-first", "latency-first"]
POLICIES = ["kvgate", *PRESETS, *PEERS, "oracle"]


def shared(groups, system, per_group=None, question=64, output=32):
    return ["--workload", "shared-prefix", "--groups", str(groups), "--system-len", str(system),
            "--question-len", str(question), "--output-len", str(output),
            *(["--prompts-per-group", str(per_group)] if per_group else [])]


def turns(n):
    return ["--workload", "multi-turn", "--turns", str(n), "--system-len", "512",
            "--turn-len", "96", "--output-len", "48"]


def trace(kind, name, block_tokens=None):
    args = ["--workload", f"{kind}:{os.path.join(TRACES, name)}"]
    return args + (["--block-tokens", str(block_tokens)] if block_tokens else [])


# name: (workload flags, requests per replica, KV blocks per replica or None for the
# default 4,096, replicas, gateways)
SHAPES = {
    "one-system-prompt": (shared(1, 1024), 100, None, 4, 1),
    "4 groups of 2k": (shared(4, 2048), 100, None, 4, 1),
    "16 groups of 1k": (shared(16, 1024), 100, None, 4, 1),
    "64 groups of 512": (shared(64, 512), 100, None, 4, 1),
    "256 groups of 256": (shared(256, 256), 100, None, 4, 1),
    "16 groups of 8k": (shared(16, 8192), 100, None, 4, 1),
    "16 groups of 2k, scarce KV": (shared(16, 2048), 100, 4 * 2112 // 16, 4, 1),
    "multi-turn, 2 turns": (turns(2), 100, None, 4, 1),
    "multi-turn, 8 turns": (turns(8), 100, None, 4, 1),
    "multi-turn, 20 turns": (turns(20), 100, None, 4, 1),
    "long documents, 8k": (shared(0, 8192, per_group=3), 60, None, 4, 1),
    "long documents, 32k": (shared(0, 32768, per_group=3), 30, None, 4, 1),
    "mooncake conversation": (trace("mooncake", "conversation_trace.jsonl", 64), 200, None, 4, 1),
    "mooncake tool-and-agent": (trace("mooncake", "synthetic_trace.jsonl", 64), 200, None, 4, 1),
    "azure code": (trace("azure", "azure2023_code.csv"), 200, None, 4, 1),
    "azure conversation": (trace("azure", "azure2023_conv.csv"), 200, None, 4, 1),
    "16 groups of 1k, 16 replicas": (shared(16, 1024), 60, None, 16, 1),
    "64 groups of 1k, 64 replicas": (shared(64, 1024), 30, None, 64, 1),
    "16 groups of 1k, 4 gateways": (shared(16, 1024), 100, None, 4, 4),
    "16 groups of 1k, 8 gateways": (shared(16, 1024), 100, None, 4, 8),
    "one-system-prompt, 8 gateways": (shared(1, 1024), 100, None, 4, 8),
    "64 groups of 512, 8 gateways": (shared(64, 512), 100, None, 4, 8),
}


# Shapes with more gateways, and the same shape through one.
MANY_GATEWAYS = [("16 groups of 1k, 4 gateways", "16 groups of 1k"),
                 ("16 groups of 1k, 8 gateways", "16 groups of 1k"),
                 ("one-system-prompt, 8 gateways", "one-system-prompt"),
                 ("64 groups of 512, 8 gateways", "64 groups of 512")]


def flags(shape, seed):
    workload, per_replica, blocks, replicas, gateways = SHAPES[shape]
    requests = per_replica * replicas
    workload = list(workload)
    if "--groups" in workload and workload[workload.index("--groups") + 1] == "0":
        # Long documents: a group per document, each asked about three times.
        workload[workload.index("--groups") + 1] = str(max(1, requests // 3))
    elif "--groups" in workload and "--prompts-per-group" not in workload:
        groups = int(workload[workload.index("--groups") + 1])
        workload += ["--prompts-per-group", str(max(1, -(-requests // groups)))]
    if is_trace(shape):
        # A trace is one arrival sequence: its seeds draw the gateways' timing noise instead.
        workload += ["--gateway-jitter-ms", "0.5", "--jitter-seed", str(seed)]
    blocks = blocks or 4096
    # An engine's pool holds at least one request of the context length.
    max_model_len = min(40_000, blocks * 16)
    return ["--replicas", str(replicas), "--gateways", str(gateways), "--num-blocks",
            str(blocks), "--max-model-len", str(max_model_len), "--requests", str(requests),
            "--seed", str(seed), "--quiet", *workload]


def is_trace(shape):
    return SHAPES[shape][0][1].startswith(("mooncake:", "azure:"))


def sim(args, out, binary=None):
    done = subprocess.run([binary or KVGATE, "sim", *args, "--out", out], cwd=ROOT, check=True,
                          capture_output=True, text=True)
    broken = [line for line in done.stdout.splitlines() if "BROKEN" in line]
    if broken:
        raise RuntimeError(f"{out}: " + "; ".join(broken))


def summary(out, policy):
    with open(os.path.join(out, policy, "summary.json")) as f:
        return json.load(f)


def trace_rate(shape, requests):
    """Requests per second of a trace's first `requests`, as recorded."""
    path = SHAPES[shape][0][1].split(":", 1)[1]
    stamps = []
    with open(path) as f:
        if path.endswith(".jsonl"):
            for line in f:
                if line.strip():
                    stamps.append(json.loads(line)["timestamp"] / 1e3)
                if len(stamps) == requests:
                    break
        else:
            next(f)
            for line in f:
                t = datetime.datetime.fromisoformat(line.split(",")[0][:26])
                stamps.append(t.timestamp())
                if len(stamps) == requests:
                    break
    return (len(stamps) - 1) / max(stamps[-1] - stamps[0], 1e-9)


def capacity(shape, out):
    """kvgate's requests per second in a closed loop of 32 jobs per replica, through one
    gateway (so that a shape with more gateways is offered the same load)."""
    path = os.path.join(out, "capacity", safe(shape))
    if not os.path.exists(os.path.join(path, "kvgate", "summary.json")):
        replicas = SHAPES[shape][3]
        args = flags(shape, 1)
        args[args.index("--gateways") + 1] = "1"
        sim(args + ["--concurrency", str(32 * replicas), "--policy", "kvgate"], path)
    return summary(path, "kvgate")["requests_per_s"]


def load_flags(shape, fraction, cap):
    if is_trace(shape):
        requests = SHAPES[shape][1] * SHAPES[shape][3]
        return ["--time-scale", f"{fraction * cap / trace_rate(shape, requests):.6g}"]
    return ["--rate", f"{fraction * cap:.6g}"]


def safe(name):
    return "".join(c if c.isalnum() else "-" for c in name)


def run_cell(shape, fraction, seed, cap, out, replays, tries=()):
    path = os.path.join(out, "cells", f"{safe(shape)}@{fraction}", f"seed{seed}")
    if not os.path.exists(os.path.join(path, "oracle", "summary.json")):
        args = flags(shape, seed) + load_flags(shape, fraction, cap)
        args += ["--oracle-replays", str(replays)]
        for p in POLICIES:
            args += ["--policy", p]
        sim(args, path)
    runs = {p: summary(path, p) for p in POLICIES}
    for t in tries:
        name = os.path.basename(t).rsplit(".", 1)[0]
        tried = os.path.join(path, "try", name)
        if not os.path.exists(os.path.join(tried, name, "summary.json")):
            sim(flags(shape, seed) + load_flags(shape, fraction, cap) + ["--policy", t], tried)
        runs["try:" + name] = summary(tried, name)
    runs["kvgate"]["replicas_per_group"] = replicas_per_group(path, "kvgate")
    runs["floor"] = floor(shape, fraction, seed, cap, path)
    return runs


def floor(shape, fraction, seed, cap, path):
    """The TTFTs no router can beat on the cell's arrivals (kvgate sim's floor/, taken over
    kvgate's run); a cell run before the floor existed gets it from kvgate's run again."""
    if not os.path.exists(os.path.join(path, "floor", "summary.json")):
        again = os.path.join(path, "floor-run")
        sim(flags(shape, seed) + load_flags(shape, fraction, cap) + ["--policy", "kvgate"], again)
        os.replace(os.path.join(again, "floor"), os.path.join(path, "floor"))
        shutil.rmtree(again)
    return summary(path, "floor")


def replicas_per_group(path, policy):
    """How many replicas each prefix group's requests went to, on average: 1 when every
    gateway sent a group to the same place."""
    groups = {}
    with open(os.path.join(path, policy, "requests.csv")) as f:
        for row in csv.DictReader(f):
            if row["group"] and row["replica"]:
                groups.setdefault(row["group"], set()).add(row["replica"])
    return statistics.mean(len(r) for r in groups.values()) if groups else 0.0


def ratios(runs):
    """kvgate's ratios in one seed's run of a cell."""
    p90 = {p: s["ttft_s"]["p90"] for p, s in runs.items()}
    cached = {p: s["cached_token_ratio"] for p, s in runs.items()}
    spread = {p: s["replica_imbalance"] for p, s in runs.items()}
    best = lambda d, f: f(d[p] for p in PEERS)
    div = lambda a, b: a / b if b > 0 else 1.0
    return {
        "p90_over_best_peer": div(p90["kvgate"], best(p90, min)),
        "p90_over_sglang": div(p90["kvgate"], p90["sglang-cache-aware"]),
        "p90_over_round_robin": div(p90["kvgate"], p90["round-robin"]),
        "p90_over_oracle": div(p90["kvgate"], p90["oracle"]),
        "p90_over_floor": div(p90["kvgate"], p90["floor"]),
        # The lowest ratios any router could reach on these arrivals.
        "floor_over_sglang": div(p90["floor"], p90["sglang-cache-aware"]),
        "floor_over_round_robin": div(p90["floor"], p90["round-robin"]),
        "oracle_over_floor": div(p90["oracle"], p90["floor"]),
        "cached_over_best_peer": div(cached["kvgate"], best(cached, max)),
        "spread_over_best_peer": div(spread["kvgate"], best(spread, min)),
        "best_peer_p90": min(PEERS, key=lambda p: p90[p]),
        "replicas_per_group": runs["kvgate"]["replicas_per_group"],
        "p90_ms": {p: v * 1e3 for p, v in p90.items()},
        "tries": {(f"preset {p}" if p in PRESETS else p[4:]): div(v, best(p90, min))
                  for p, v in p90.items() if p in PRESETS or p.startswith("try:")},
        "cached": cached,
    }


RATIOS = ["p90_over_best_peer", "p90_over_sglang", "p90_over_round_robin", "p90_over_oracle",
          "p90_over_floor", "floor_over_sglang", "cached_over_best_peer",
          "spread_over_best_peer"]
BOUNDS = ["floor_over_round_robin", "oracle_over_floor"]


CONFIDENCE = 0.9


def median_interval(values, confidence=CONFIDENCE):
    """(low, high, coverage): the narrowest pair of order statistics around the median that
    holds the true median with at least `confidence` (each seed's value is as likely above it as
    below, whatever the distribution); the range and its coverage when no pair reaches it."""
    xs, n = sorted(values), len(values)

    def coverage(k):  # of [x(k), x(n+1-k)], 1-based
        return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2 ** n

    k = 1
    while 2 * (k + 1) <= n + 1 and coverage(k + 1) >= confidence:
        k += 1
    return xs[k - 1], xs[n - k], coverage(k)


def aggregate(per_seed):
    cell = {}
    for r in RATIOS + BOUNDS:
        values = [s[r] for s in per_seed]
        cell[r] = statistics.median(values)
        cell[r + "_noise"] = (max(values) - min(values)) / 2
    for r in ("p90_over_best_peer", "cached_over_best_peer"):
        cell[r + "_interval"] = median_interval([s[r] for s in per_seed])
    cell["best_peer_p90"] = [s["best_peer_p90"] for s in per_seed]
    cell["replicas_per_group"] = statistics.median(s["replicas_per_group"] for s in per_seed)
    cell["p90_ms"] = {p: statistics.median(s["p90_ms"][p] for s in per_seed)
                      for p in POLICIES + ["floor"]}
    cell["tries"] = {t: statistics.median(s["tries"][t] for s in per_seed)
                     for t in per_seed[0]["tries"]}
    return cell


def exchange_table(args, caps, cells):
    """kvgate on the many-gateway shapes with the gateways exchanging decisions and backlogs,
    beside the same shapes without and through one gateway. The ratio to one gateway is taken
    per seed, on the same arrivals, then the median: a shape's P90 varies with its arrivals
    (bursts) far more than with the number of gateways."""
    def run(shape, fraction, seed, exchange):
        name = "with" if exchange else "one"
        out = os.path.join(args.out, "exchange", name, f"{safe(shape)}@{fraction}", f"seed{seed}")
        if not os.path.exists(os.path.join(out, "kvgate", "summary.json")):
            ms = ["--gateway-exchange-ms", str(args.exchange_ms)] if exchange else []
            sim(flags(shape, seed) + load_flags(shape, fraction, caps[shape]) + ms
                + ["--policy", "kvgate"], out)
        return summary(out, "kvgate")["ttft_s"]["p90"] * 1e3, replicas_per_group(out, "kvgate")
    lines = [f"| shape | load | kvgate P90 ms, one gateway | without the exchange | with it "
             f"({args.exchange_ms} ms) | with it ÷ one gateway, per seed | replicas per group, "
             f"without | with |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    seeds = range(1, args.exchange_seeds + 1)
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for many, one in MANY_GATEWAYS:
            if many not in caps or f"{one}@{LOADS[0]}" not in cells:
                continue
            for load in LOADS:
                with_ = list(pool.map(lambda seed: run(many, load, seed, True), seeds))
                alone = list(pool.map(lambda seed: run(one, load, seed, False), seeds))
                p90, rpg = (statistics.median(x[i] for x in with_) for i in (0, 1))
                base = statistics.median(x[0] for x in alone)
                paired = [w[0] / o[0] for w, o in zip(with_, alone)]
                a = cells[f"{many}@{load}"]
                lines.append(f"| {many} | {load} | {base:.1f} | {a['p90_ms']['kvgate']:.1f} | "
                             f"{p90:.1f} | {statistics.median(paired):.2f} ± "
                             f"{(max(paired) - min(paired)) / 2:.2f} | "
                             f"{a['replicas_per_group']:.2f} | {rpg:.2f} |")
    return "\n".join(lines) + "\n"

def tries_table(cells):
    """Each preset's and tried policy's P90 over the best peer's across the grid, beside the
    default's."""
    names = ["default"] + list(next(iter(cells.values()))["tries"])
    of = lambda c, n: c["p90_over_best_peer"] if n == "default" else c["tries"][n]
    lines = ["| policy | median cell | worst cell | cells over 1.05 | cells over 1.25 | "
             "cells 5 % worse than the default |", "|---|---:|---:|---:|---:|---:|"]
    for n in names:
        v = sorted(of(c, n) for c in cells.values())
        worse = sum(of(c, n) > 1.05 * of(c, "default") for c in cells.values())
        lines.append(f"| {n} | {statistics.median(v):.3f} | {v[-1]:.2f} | "
                     f"{sum(x > 1.05 for x in v)} of {len(v)} | {sum(x > 1.25 for x in v)} | "
                     f"{worse} |")
    return "\n".join(lines) + "\n"


def heat_map(path, title, cells, key, good_below=True):
    """An SVG grid of shapes (rows) by load (columns), each square coloured by its ratio."""
    shapes = list(SHAPES)
    w, h, left, top = 90, 22, 260, 50
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + w * len(LOADS) + 20}" '
           f'height="{top + h * len(shapes) + 40}" font-family="sans-serif" font-size="12">',
           f'<text x="10" y="20" font-size="14">{title}</text>']
    for j, load in enumerate(LOADS):
        out.append(f'<text x="{left + j * w + w / 2}" y="{top - 8}" text-anchor="middle">'
                   f'{load} of capacity</text>')
    for i, shape in enumerate(shapes):
        y = top + i * h
        out.append(f'<text x="{left - 6}" y="{y + 15}" text-anchor="end">{shape}</text>')
        for j, load in enumerate(LOADS):
            c = cells.get(f"{shape}@{load}")
            x = left + j * w
            if c is None:
                out.append(f'<rect x="{x}" y="{y}" width="{w - 2}" height="{h - 2}" fill="#eee"/>')
                continue
            v = c[key]
            worse = (v - 1) if good_below else (1 - v)
            # White at 1, to red at 50 % worse and to green at 50 % better.
            t = max(-1.0, min(1.0, worse / 0.5))
            to = (220, 60, 60) if t > 0 else (70, 170, 90)
            fill = "rgb({},{},{})".format(*(int(255 + (c - 255) * abs(t)) for c in to))
            out.append(f'<rect x="{x}" y="{y}" width="{w - 2}" height="{h - 2}" fill="{fill}"/>')
            out.append(f'<text x="{x + w / 2 - 1}" y="{y + 15}" text-anchor="middle">'
                       f'{v:.2f}±{c[key + "_noise"]:.2f}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/kvgate-grid")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--only", default="")
    ap.add_argument("--oracle-replays", type=int, default=16)
    ap.add_argument("--exchange-ms", type=int, default=None,
                    help="also run kvgate on the many-gateway shapes with gateways telling "
                         "each other their decisions and backlogs after this many ms")
    ap.add_argument("--exchange-seeds", type=int, default=15,
                    help="seeds of each many-gateway cell with the exchange")
    ap.add_argument("--exchange-only", metavar="GRID_JSON",
                    help="run only the exchange's table, on the capacities and cells of an "
                         "earlier run's grid.json (its cells without the exchange)")
    ap.add_argument("--try", dest="tries", nargs="*", default=[], metavar="POLICY.yaml",
                    help="policy files to try on every cell beside the default")
    args = ap.parse_args()
    args.tries = [os.path.abspath(t) for t in args.tries]
    subprocess.run(["cargo", "build", "--release", "--bin", "kvgate"], cwd=ROOT, check=True)
    if args.exchange_only:
        with open(args.exchange_only) as f:
            earlier = json.load(f)
        text = exchange_table(args, earlier["capacity_rps"], earlier["cells"])
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "exchange.md"), "w") as f:
            f.write(text)
        print(text)
        return
    shapes = [s for s in SHAPES if args.only in s]
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        caps = dict(zip(shapes, pool.map(lambda s: capacity(s, args.out), shapes)))
        work = {(s, f, seed): pool.submit(run_cell, s, f, seed, caps[s], args.out,
                                          args.oracle_replays, args.tries)
                for s in shapes for f in LOADS for seed in range(1, args.seeds + 1)}
        cells = {}
        for s in shapes:
            for f in LOADS:
                per_seed = [ratios(work[(s, f, seed)].result())
                            for seed in range(1, args.seeds + 1)]
                cells[f"{s}@{f}"] = aggregate(per_seed)
                c = cells[f"{s}@{f}"]
                print(f"{s} @ {f}: P90 {c['p90_over_best_peer']:.2f}±"
                      f"{c['p90_over_best_peer_noise']:.2f} of the best peer's, "
                      f"{c['p90_over_oracle']:.2f} of the oracle's", flush=True)
    with open(os.path.join(args.out, "grid.json"), "w") as f:
        json.dump({"capacity_rps": caps, "cells": cells}, f, indent=1)
    table = ["| shape | load | kvgate P90 ms | best peer (P90 ms) | ÷ best peer | ÷ SGLang | "
             "÷ round-robin | ÷ oracle | ÷ floor | floor ÷ SGLang | cached ÷ best peer | "
             "spread ÷ best peer |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for key, c in cells.items():
        shape, load = key.rsplit("@", 1)
        peer = statistics.mode(c["best_peer_p90"])
        table.append(
            f"| {shape} | {load} | {c['p90_ms']['kvgate']:.1f} | {peer} "
            f"({c['p90_ms'][peer]:.1f}) | "
            + " | ".join(f"{c[r]:.2f} ± {c[r + '_noise']:.2f}" for r in RATIOS) + " |")
    goals = []
    for r, better in [("p90_over_best_peer", min), ("p90_over_sglang", min),
                      ("p90_over_round_robin", min), ("p90_over_oracle", min),
                      ("cached_over_best_peer", max)]:
        values = sorted(c[r] for c in cells.values())
        worst = max(values) if better is min else min(values)
        goals.append(f"{r}: median cell {statistics.median(values):.2f}, worst {worst:.2f}")
    # Per cell and seed no router's P90 is below the floor's, so no router's median cell over
    # SGLang's (round-robin's) is below the median cell of the floor over theirs.
    for r, goal in [("floor_over_sglang", "p90_over_sglang <= 0.7"),
                    ("floor_over_round_robin", "p90_over_round_robin <= 0.25")]:
        values = [c[r] for c in cells.values()]
        goals.append(f"{r}: median cell {statistics.median(values):.2f}, the lowest any router "
                     f"could reach for the median cell (goal {goal})")
    goals.append("oracle_over_floor: median cell "
                 f"{statistics.median(c['oracle_over_floor'] for c in cells.values()):.2f}")
    coverage = min(c["p90_over_best_peer_interval"][2] for c in cells.values())
    for r, missed, goal in [("p90_over_best_peer", lambda lo, hi: lo > 1.0, "over 1.0"),
                            ("cached_over_best_peer", lambda lo, hi: hi < 0.95, "under 0.95")]:
        beyond = [f"{k} ({c[r + '_interval'][0]:.2f}-{c[r + '_interval'][1]:.2f})"
                  for k, c in cells.items() if missed(*c[r + "_interval"][:2])]
        goals.append(f"{r}: {len(beyond)} of {len(cells)} cells {goal} beyond the median's "
                     f"interval (coverage at least {coverage:.0%})"
                     + (": " + "; ".join(beyond) if beyond else ""))
    gateways = ["| shape | load | kvgate P90 ms, one gateway | with more | ratio | replicas per "
                "group, one gateway | with more |", "|---|---:|---:|---:|---:|---:|---:|"]
    for many, one in MANY_GATEWAYS:
        for load in LOADS:
            a, b = cells.get(f"{many}@{load}"), cells.get(f"{one}@{load}")
            if a and b:
                gateways.append(
                    f"| {many} | {load} | {b['p90_ms']['kvgate']:.1f} | "
                    f"{a['p90_ms']['kvgate']:.1f} | "
                    f"{a['p90_ms']['kvgate'] / b['p90_ms']['kvgate']:.2f} | "
                    f"{b['replicas_per_group']:.2f} | {a['replicas_per_group']:.2f} |")
    text = ("\n".join(table) + "\n\n" + "\n".join(goals) + "\n\n" + "\n".join(gateways)
            + "\n")
    text += "\n" + tries_table(cells)
    if args.exchange_ms is not None:
        text += "\n" + exchange_table(args, caps, cells)
    with open(os.path.join(args.out, "grid.md"), "w") as f:
        f.write(text)
    print(text)
    for r, title, below in [
            ("p90_over_best_peer", "kvgate's P90 TTFT over the best peer's", True),
            ("p90_over_oracle", "kvgate's P90 TTFT over the oracle's", True),
            ("cached_over_best_peer", "kvgate's cached ratio over the best peer's", False),
            ("spread_over_best_peer", "kvgate's per-replica spread over the best peer's", True)]:
        heat_map(os.path.join(args.out, f"heat_{r}.svg"), title, cells, r, below)


if __name__ == "__main__":
    sys.exit(main())
