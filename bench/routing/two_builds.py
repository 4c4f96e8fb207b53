#!/usr/bin/env python3
"""Two builds of kvgate on the grid's cells, kvgate's default alone, on the same arrivals: the
capacities of a stored grid run, so that neither build's own capacity moves the load.

    bench/routing/two_builds.py --before BIN --after BIN [--caps GRID_JSON] [--seeds 4]
                                [--only TEXT] [--out DIR]

Prints, per cell, the median over the seeds of AFTER's P90 TTFT over BEFORE's and each seed's
ratio (marked where the median moved by more than 3 %), then the geometric mean over the cells.
Much cheaper than `grid.py` (no peers, no oracle): a change to the policy checked on every
shape before the grid is run again.
"""
import argparse, concurrent.futures, json, math, os, statistics, sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import grid  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", required=True)
    ap.add_argument("--caps", default=os.path.join(grid.ROOT, "bench", "routing", "results",
                                                   "grid-sixteenth", "grid.json"))
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--only", default="")
    ap.add_argument("--out", default="/tmp/kvgate-two-builds")
    args = ap.parse_args()
    with open(args.caps) as f:
        caps = json.load(f)["capacity_rps"]
    shapes = [s for s in grid.SHAPES if args.only in s and s in caps]

    def p90(shape, load, seed, tag, binary):
        out = os.path.join(args.out, tag, f"{grid.safe(shape)}@{load}", f"seed{seed}")
        if not os.path.exists(os.path.join(out, "kvgate", "summary.json")):
            grid.sim(grid.flags(shape, seed) + grid.load_flags(shape, load, caps[shape])
                     + ["--policy", "kvgate"], out, binary)
        return grid.summary(out, "kvgate")["ttft_s"]["p90"]

    seeds = range(1, args.seeds + 1)
    cells = [(s, load) for s in shapes for load in grid.LOADS]
    medians = []
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        runs = {(c, k, tag): ex.submit(p90, *c, k, tag, binary) for c in cells for k in seeds
                for tag, binary in (("before", args.before), ("after", args.after))}
        for c in cells:
            ratios = [runs[(c, k, "after")].result() / runs[(c, k, "before")].result()
                      for k in seeds]
            m = statistics.median(ratios)
            medians.append(m)
            mark = " <<" if m > 1.03 else (" >>" if m < 0.97 else "")
            print(f"{c[0]:<34} {c[1]:<4} {m:.3f} {[round(r, 2) for r in ratios]}{mark}",
                  flush=True)
    print(f"geometric mean {math.exp(statistics.fmean(map(math.log, medians))):.4f}")


if __name__ == "__main__":
    main()
