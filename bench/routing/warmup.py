#!/usr/bin/env python3
"""The grid's many-gateway cells at the grid's length and longer: how much of a cell's P90 is
its cold start.

A grid cell offers 100 requests a replica (400 on its 4 replicas, under a second at its
load), so its P90, the worst 40 requests, can be decided by the first tenth of a second:
before any agent's report reaches a gateway, while gateways that share nothing each see only
their own requests. This runs kvgate, every peer, and kvgate through one gateway on the same
cells with the grid's request count and with `--factor` times it (the grid's capacities,
`--caps-from` a grid's `--out`), over `--seeds` seeds, and prints kvgate's P90 over the best
peer's (the median of the seeds' ratios) for each length.

    bench/routing/warmup.py --caps-from /tmp/kvgate-grid --out DIR [--factor 10] [--seeds 3]
"""

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess

import grid

SHAPES = [s for s in grid.SHAPES if grid.SHAPES[s][4] > 1]
LOADS = [0.6, 1.1]
ONE_GATEWAY = "kvgate, one gateway"


def flags(shape, seed, factor):
    args = grid.flags(shape, seed)
    requests = int(args[args.index("--requests") + 1]) * factor
    groups = int(args[args.index("--groups") + 1])
    args[args.index("--requests") + 1] = str(requests)
    args[args.index("--prompts-per-group") + 1] = str(-(-requests // groups))
    return args


def run(shape, load, factor, seed, cap, out):
    """Every policy's summary on one cell: the peers and kvgate through the shape's gateways,
    and kvgate through one."""
    path = os.path.join(out, f"{grid.safe(shape)}@{load}x{factor}", f"seed{seed}")
    args = flags(shape, seed, factor) + grid.load_flags(shape, load, cap)
    if not os.path.exists(os.path.join(path, grid.PEERS[-1], "summary.json")):
        policies = [a for p in ["kvgate", *grid.PEERS] for a in ("--policy", p)]
        grid.sim(args + policies, path)
    alone = os.path.join(path, "one-gateway")
    if not os.path.exists(os.path.join(alone, "kvgate", "summary.json")):
        one = list(args)
        one[one.index("--gateways") + 1] = "1"
        grid.sim(one + ["--policy", "kvgate"], alone)
    runs = {p: grid.summary(path, p) for p in ["kvgate", *grid.PEERS]}
    runs[ONE_GATEWAY] = grid.summary(alone, "kvgate")
    return runs


def p90(summary):
    return summary["ttft_s"]["p90"] * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--caps-from", required=True, help="a grid run's --out (its capacities)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--factor", type=int, default=10)
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    subprocess.run(["cargo", "build", "--release", "--bin", "kvgate"], cwd=grid.ROOT, check=True)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        caps = {s: grid.capacity(s, args.caps_from) for s in SHAPES}
        work = {(s, load, f, seed): pool.submit(run, s, load, f, seed, caps[s], args.out)
                for s in SHAPES for load in LOADS for f in (1, args.factor)
                for seed in range(1, args.seeds + 1)}
        table = ["| shape | load | requests | kvgate P90 ms | best peer (P90 ms) | kvgate ÷ best "
                 "peer | kvgate through one gateway, P90 ms |",
                 "|---|---:|---:|---:|---|---:|---:|"]
        for (s, load, f, seed) in work:
            if seed != 1:
                continue
            runs = [work[(s, load, f, k)].result() for k in range(1, args.seeds + 1)]
            med = lambda p: statistics.median(p90(r[p]) for r in runs)
            best = min(grid.PEERS, key=med)
            ratio = statistics.median(p90(r["kvgate"]) / p90(r[best]) for r in runs)
            requests = flags(s, 1, f)[flags(s, 1, f).index("--requests") + 1]
            table.append(f"| {s} | {load} | {int(requests):,} | {med('kvgate'):.1f} | {best} "
                         f"({med(best):.1f}) | {ratio:.2f} | {med(ONE_GATEWAY):.1f} |")
    text = "\n".join(table) + "\n"
    with open(os.path.join(args.out, "warmup.md"), "w") as f:
        f.write(text)
    print(text, end="")


if __name__ == "__main__":
    main()
