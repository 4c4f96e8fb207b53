#!/usr/bin/env python3
"""A grid shape run ten times longer, to tell a policy's steady state from its warm-up: the
grid's cells are 100 requests per replica, so a policy that needs evidence before it spreads
(the hot-group rule, with gateways that each see a share of the traffic) is measured mostly
while it gathers it.

For each load (a fraction of the shape's capacity, from a grid run's grid.json) and seed, runs
kvgate, kvgate with the gateways exchanging decisions (many-gateway shapes), and the peers on
the same arrivals (`kvgate sim`), and prints per load the medians over the seeds of kvgate's
P90 TTFT over the whole run and after the first --skip of it, the best peer's after it, and
kvgate's ratios.

Usage: bench/routing/steady.py --grid GRID_JSON [--shape 'one-system-prompt, 8 gateways']
                               [--times 10] [--seeds 3] [--skip 0.2] [--out DIR]
"""
import argparse, csv, json, os, statistics, subprocess, tempfile

import grid


def p90_after(path, skip):
    with open(path) as f:
        rows = list(csv.DictReader(f))
    end = max(float(r["start_s"]) for r in rows)
    ttft = sorted(float(r["ttft_s"]) * 1e3 for r in rows if float(r["start_s"]) >= skip * end)
    return ttft[int(len(ttft) * 0.9)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--grid", required=True)
    ap.add_argument("--shape", default="one-system-prompt, 8 gateways")
    ap.add_argument("--times", type=int, default=10)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--skip", type=float, default=0.2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    with open(args.grid) as f:
        cap = json.load(f)["capacity_rps"][args.shape]
    out = args.out or tempfile.mkdtemp(prefix="kvgate-steady-")
    many = grid.SHAPES[args.shape][4] > 1
    print(f"{args.shape}, {args.times}x the grid's requests, {args.seeds} seeds; P90 ms over "
          f"the whole run / after its first {args.skip:.0%}; results in {out}")
    print("| load | kvgate | kvgate, exchange | best peer after | kvgate ÷ best peer | "
          "with the exchange | round-robin after |")
    print("|---:|---:|---:|---|---:|---:|---:|")
    for load in grid.LOADS:
        runs = {}
        for seed in range(1, args.seeds + 1):
            flags = grid.flags(args.shape, seed) + grid.load_flags(args.shape, load, cap)
            for name in ("--requests", "--prompts-per-group"):
                if name in flags:
                    i = flags.index(name) + 1
                    flags[i] = str(int(flags[i]) * args.times)
            cell = os.path.join(out, f"{load}", f"seed{seed}")
            policies = ["kvgate", *grid.PEERS]
            grid.sim(flags + sum((["--policy", p] for p in policies), []), cell)
            if many:
                grid.sim(flags + ["--gateway-exchange-ms", "2", "--policy", "kvgate"],
                         os.path.join(cell, "exchange"))
                policies.append("exchange/kvgate")
            for p in policies:
                path = os.path.join(cell, p, "requests.csv")
                runs.setdefault(p, []).append((p90_after(path, 0), p90_after(path, args.skip)))
        med = {p: [statistics.median(r[i] for r in v) for i in (0, 1)] for p, v in runs.items()}
        best = min(grid.PEERS, key=lambda p: med[p][1])
        exchange = med.get("exchange/kvgate")
        with_it, ratio = ("–", "–") if exchange is None else (
            f"{exchange[0]:.1f} / {exchange[1]:.1f}", f"{exchange[1] / med[best][1]:.2f}")
        print(f"| {load} | {med['kvgate'][0]:.1f} / {med['kvgate'][1]:.1f} | {with_it} | "
              f"{best} ({med[best][1]:.1f}) | {med['kvgate'][1] / med[best][1]:.2f} | {ratio} | "
              f"{med['round-robin'][1]:.1f} |", flush=True)


if __name__ == "__main__":
    main()
