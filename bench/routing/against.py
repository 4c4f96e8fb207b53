#!/usr/bin/env python3
"""kvgate's default against another build of it, on a grid run's cells: the same arrivals
(the grid's capacities and seeds), so that a change to the policy is measured cell by cell.

    bench/routing/against.py --grid DIR --baseline BINARY [--seeds 12] [--only TEXT]

DIR is an earlier `grid.py --out` (its capacities, and its cells' kvgate runs by the build
being measured); BINARY is the other build's `kvgate` (say, `main`'s before the change, built
in a worktree). The baseline's runs go to DIR/against/. Prints, per cell, the median over the
seeds of the grid's kvgate P90 TTFT over the baseline's and the interval that holds that median
with 90% confidence, then the geometric mean over the cells.
"""

import argparse
import concurrent.futures
import math
import os
import statistics

import grid


def p90(path, policy):
    return grid.summary(path, policy)["ttft_s"]["p90"]


def ratio(shape, load, seed, cap, args):
    cell = f"{grid.safe(shape)}@{load}"
    measured = os.path.join(args.grid, "cells", cell, f"seed{seed}")
    baseline = os.path.join(args.grid, "against", cell, f"seed{seed}")
    if not os.path.exists(os.path.join(baseline, "kvgate", "summary.json")):
        grid.sim(grid.flags(shape, seed) + grid.load_flags(shape, load, cap)
                 + ["--policy", "kvgate"], baseline)
    return p90(measured, "kvgate") / p90(baseline, "kvgate")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--grid", required=True, help="a grid.py --out, by the build measured")
    ap.add_argument("--baseline", required=True, help="the other build's kvgate binary")
    ap.add_argument("--seeds", type=int, default=12)
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    grid.KVGATE = os.path.abspath(args.baseline)
    shapes = [s for s in grid.SHAPES if args.only in s]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        work = {(s, load, seed): pool.submit(ratio, s, load, seed,
                                             grid.capacity(s, args.grid), args)
                for s in shapes for load in grid.LOADS for seed in range(1, args.seeds + 1)}
        logs = []
        print("| shape | load | P90 ÷ baseline's | 90% interval |\n|---|---:|---:|---|")
        for s in shapes:
            for load in grid.LOADS:
                values = [work[(s, load, k)].result() for k in range(1, args.seeds + 1)]
                low, high, _ = grid.median_interval(values)
                median = statistics.median(values)
                logs.append(math.log(median))
                print(f"| {s} | {load} | {median:.3f} | {low:.3f}-{high:.3f} |", flush=True)
    print(f"\ngeometric mean over {len(logs)} cells: {math.exp(statistics.mean(logs)):.4f}")


if __name__ == "__main__":
    main()
