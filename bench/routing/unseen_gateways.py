#!/usr/bin/env python3
"""Shared-prefix shapes through more gateways than the grid's, gateways sharing nothing: kvgate
and another build of it against the best peer, on the same arrivals.

The grid's many-gateway shapes are 4 and 8 gateways on 16 and 64 groups and one system
prompt. These are the same fleet (4 replicas, 100 requests a replica, the grid's capacities
from `--caps-from`, a grid's `--out`) with 4 to 16 gateways and other group counts. Per cell
it prints the median over the seeds of each build's P90 TTFT over the best peer's.

    bench/routing/unseen_gateways.py --caps-from GRID_OUT --baseline BINARY --out DIR [--seeds 6]
"""

import argparse
import concurrent.futures
import json
import os
import statistics

import grid

# (the grid's shape, whose capacity and workload it takes; gateways; load)
CELLS = [("one-system-prompt", 4, 1.1), ("one-system-prompt", 16, 0.6),
         ("one-system-prompt", 16, 0.9), ("4 groups of 2k", 8, 0.6), ("4 groups of 2k", 8, 1.1),
         ("256 groups of 256", 8, 1.1), ("16 groups of 1k", 16, 1.1)]


def run(cell, seed, who, args, caps):
    shape, gateways, load = cell
    path = os.path.join(args.out, f"{grid.safe(shape)}-{gateways}gw@{load}", f"seed{seed}", who)
    policies = grid.PEERS if who == "peers" else ["kvgate"]
    if not os.path.exists(os.path.join(path, policies[-1], "summary.json")):
        flags = grid.flags(shape, seed)
        flags[flags.index("--gateways") + 1] = str(gateways)
        flags += grid.load_flags(shape, load, caps[shape])
        binary = args.baseline if who == "baseline" else None
        grid.sim(flags + [a for p in policies for a in ("--policy", p)], path, binary)
    return {p: grid.summary(path, p)["ttft_s"]["p90"] for p in policies}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--caps-from", required=True, help="a grid.py --out (its capacities)")
    ap.add_argument("--baseline", required=True, help="another build's kvgate binary")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seeds", type=int, default=6)
    args = ap.parse_args()
    args.baseline = os.path.abspath(args.baseline)
    with open(os.path.join(args.caps_from, "grid.json")) as f:
        caps = json.load(f)["capacity_rps"]
    seeds = range(1, args.seeds + 1)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        work = {(c, s, w): pool.submit(run, c, s, w, args, caps)
                for c in CELLS for s in seeds for w in ("peers", "kvgate", "baseline")}
        print("| shape | gateways | load | kvgate P90 ÷ best peer's | baseline's |")
        print("|---|---:|---:|---:|---:|")
        for c in CELLS:
            ratios = {"kvgate": [], "baseline": []}
            for s in seeds:
                best = min(work[(c, s, "peers")].result().values())
                for w, values in ratios.items():
                    values.append(work[(c, s, w)].result()["kvgate"] / best)
            print(f"| {c[0]} | {c[1]} | {c[2]} | {statistics.median(ratios['kvgate']):.2f} | "
                  f"{statistics.median(ratios['baseline']):.2f} |", flush=True)


if __name__ == "__main__":
    main()
