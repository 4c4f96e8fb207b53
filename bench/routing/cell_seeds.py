#!/usr/bin/env python3
"""One off-grid cell over many seeds: every peer and two builds of kvgate's default on the same
arrivals, per seed, in `kvgate sim` (H200 / Llama-3.1-8B profile).

    bench/routing/cell_seeds.py --draw 2 --cell 30 --caps-from BASE --before BIN --after BIN
                                [--seeds 12] [--out DIR]

A cell of `offgrid.py --draw N` moves on two seeds; this tells whether it moves on twelve.
BASE is an earlier `offgrid.py` OUT of the same draw: the cell's capacity is read from it, so
both builds see the draw's arrivals. Prints one line per seed (each build's P90 TTFT, the best
peer's, and the ratios), then the medians, also over the better of Dynamo and SGLang's
cache_aware; writes OUT/summary.txt and OUT/rows.json.
"""
import argparse, concurrent.futures, json, os, random, statistics, subprocess, sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import grid  # noqa: E402
import offgrid  # noqa: E402


def run(binary, arrivals, out, policies):
    """Each policy's P90 TTFT on one seed's arrivals."""
    cmd = [binary, "sim", *arrivals, "--out", out]
    for p in policies:
        cmd += ["--policy", p]
    subprocess.run(cmd, check=True, capture_output=True, cwd=grid.ROOT)
    return {p: grid.summary(out, p)["ttft_s"]["p90"] for p in policies}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draw", type=int, required=True)
    ap.add_argument("--cell", type=int, required=True)
    ap.add_argument("--caps-from", required=True, metavar="BASE")
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", required=True)
    ap.add_argument("--seeds", type=int, default=12)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default="/tmp/kvgate-cell-seeds")
    args = ap.parse_args()
    rng = random.Random(args.draw)
    shape = [offgrid.draw_shape(rng) for _ in range(args.cell + 1)][args.cell]
    with open(os.path.join(args.caps_from, f"c{args.cell}", "capacity", "kvgate",
                           "summary.json")) as f:
        rate = shape["load"] * json.load(f)["requests_per_s"]

    def seed_row(seed):
        arrivals = offgrid.flags(shape, seed) + ["--rate", f"{rate:.6g}"]
        out = os.path.join(args.out, f"seed{seed}")
        before = run(args.before, arrivals, os.path.join(out, "before"), ["kvgate", *grid.PEERS])
        after = run(args.after, arrivals, os.path.join(out, "after"), ["kvgate"])
        return {**{p: before[p] for p in grid.PEERS}, "before": before["kvgate"],
                "after": after["kvgate"]}

    with concurrent.futures.ThreadPoolExecutor(args.jobs) as ex:
        rows = list(ex.map(seed_row, range(1, args.seeds + 1)))
    best = [min(r[p] for p in grid.PEERS) for r in rows]
    named = [min(r["dynamo"], r["sglang-cache-aware"]) for r in rows]
    med = statistics.median
    lines = [f"draw {args.draw} c{args.cell}: {offgrid.describe(shape)}, rate {rate:.6g}/s, "
             f"{args.seeds} seeds",
             "seed  before_p90_s  after_p90_s  best_peer_p90_s  before/best  after/best  "
             "after/before"]
    for i, (r, b) in enumerate(zip(rows, best), 1):
        lines.append(f"{i:4d}  {r['before']:.4f}  {r['after']:.4f}  {b:.4f}  "
                     f"{r['before'] / b:.3f}  {r['after'] / b:.3f}  {r['after'] / r['before']:.3f}")
    lines.append(f"median before/best {med([r['before'] / b for r, b in zip(rows, best)]):.3f}  "
                 f"after/best {med([r['after'] / b for r, b in zip(rows, best)]):.3f}  "
                 f"after/before {med([r['after'] / r['before'] for r in rows]):.3f}")
    lines.append("median over the better of dynamo and sglang: "
                 f"before {med([r['before'] / n for r, n in zip(rows, named)]):.3f} "
                 f"after {med([r['after'] / n for r, n in zip(rows, named)]):.3f}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "summary.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, "rows.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
