#!/usr/bin/env python3
"""Off the grid: kvgate's default against the peers on workload shapes drawn at random from a
wider space than the grid's named cells, in `kvgate sim` (H200 / Llama-3.1-8B profile).

The grid (grid.py) fixes its shapes, and a policy tuned on them can still lose on a shape
next to them. Here each cell draws, from --draw: 2, 4, 8 or 12 replicas; 1 or 2 gateways;
shared-prefix traffic (1-512 groups, 128- to 4k-token system prompts, 16- to 512-token
questions, 8- to 256-token answers) or multi-turn sessions (3-12 turns of 32 or 256 tokens,
no system prompt or one of 512 or 2k); ample KV or room for 2-8 prompts per replica; and a load
of 0.2-1.3 of the shape's capacity (kvgate's closed-loop throughput, 32 jobs per replica, as
in the grid). Every cell runs kvgate and every peer on the same arrivals over --seeds seeds.

Prints one line per cell (kvgate's P90 TTFT over the best peer's, the per-seed ratios, and
the cached ratio over the best peer's, medians over the seeds) and a summary: the median
cell, the geometric mean, and how many cells are over 1.05 and 1.25 of the best peer. Writes
OUT/cN/ (kvgate sim's results; a cell already there is not run again) and OUT/offgrid.json.

Usage: bench/routing/offgrid.py [--draw 2] [--cells 100] [--seeds 4] [--jobs 2] [--out DIR]
                                [--caps-from DIR] [--kvgate BINARY] [--try POLICY.yaml ...]
                                [--exchange-ms MS] [--peers-from DIR] [--times N]
--caps-from takes each cell's capacity from an earlier run's OUT, so that two builds are
offered the same arrivals (a capacity is measured with the build's own default). --try runs
kvgate policy files on every cell too, on the same arrivals, and prints and sums up each one's
P90 over the best peer's beside the default's. --exchange-ms also runs kvgate on every cell
with two gateways with them telling each other their decisions and prefill backlogs every MS
(`peers:`, `kvgate sim --gateway-exchange-ms`), on the same arrivals, and sums the draw up as
deployed too: those cells with the exchange, the others as they are (one gateway has no peers).
--peers-from takes the peers' runs (and the capacities) from an earlier OUT of the same draw and
seeds, and runs only kvgate: another build of it against the same peers at a tenth of the cost
(the peers' algorithms are the simulator's, the same in either build). --times runs each cell
N times longer (the capacities stay those of the grid's length): a policy's steady state
rather than its warm-up.
"""
import argparse, concurrent.futures, json, os, random, statistics, subprocess, sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import grid  # noqa: E402


def draw_shape(rng):
    replicas, gateways = rng.choice([2, 4, 4, 8, 12]), rng.choice([1, 1, 1, 2])
    if rng.random() < 0.75:
        groups, system = rng.choice([1, 2, 8, 32, 128, 512]), rng.choice([128, 512, 2048, 4096])
        workload = ["--workload", "shared-prefix", "--groups", str(groups), "--system-len",
                    str(system), "--question-len", str(rng.choice([16, 128, 512])),
                    "--output-len", str(rng.choice([8, 64, 256]))]
        prompt = system + 600
    else:
        turns, turn_len = rng.choice([3, 5, 12]), rng.choice([32, 256])
        workload = ["--workload", "multi-turn", "--turns", str(turns), "--system-len",
                    str(rng.choice([0, 512, 2048])), "--turn-len", str(turn_len),
                    "--output-len", str(rng.choice([16, 96]))]
        prompt = 2048 + turns * (turn_len + 100)
    scarce = max(64, prompt * rng.choice([2, 4, 8]) // 16)
    blocks = rng.choice([4096, 4096, scarce])
    return {"replicas": replicas, "gateways": gateways, "workload": workload,
            "blocks": blocks, "load": rng.choice([0.2, 0.5, 0.8, 1.0, 1.3])}


def describe(shape):
    words = [w for w in shape["workload"][1:] if not w.startswith("--")]
    return (f"{shape['replicas']} replicas, {shape['gateways']} gw, {shape['blocks']} blocks, "
            f"load {shape['load']}: " + " ".join(words))


TIMES = 1  # --times: each cell's requests (100 a replica) this many times over


def flags(shape, seed, times=None):
    requests = 100 * shape["replicas"] * (times or TIMES)
    workload = list(shape["workload"])
    if "--groups" in workload:
        groups = int(workload[workload.index("--groups") + 1])
        workload += ["--prompts-per-group", str(-(-requests // groups))]
    return ["--replicas", str(shape["replicas"]), "--gateways", str(shape["gateways"]),
            "--num-blocks", str(shape["blocks"]),
            "--max-model-len", str(min(40_000, shape["blocks"] * 16)),
            "--requests", str(requests), "--seed", str(seed), "--quiet", *workload]


def name_of(policy):
    return os.path.basename(policy).rsplit(".", 1)[0]


def run(args, out, policies):
    if not all(os.path.exists(os.path.join(out, name_of(p), "summary.json")) for p in policies):
        for p in policies:
            args = args + ["--policy", p]
        grid.sim(args, out)
    return {name_of(p): grid.summary(out, name_of(p)) for p in policies}


def run_seed(arrivals, out, args, peers_from):
    """kvgate, the tried policies and the peers on one seed's arrivals; the peers' runs read
    from `peers_from` where given."""
    if not peers_from:
        return run(arrivals, out, ["kvgate", *grid.PEERS, *args.tries])
    return {**{p: grid.summary(peers_from, p) for p in grid.PEERS},
            **run(arrivals, out, ["kvgate", *args.tries])}


def capacity(shape, out):
    args = flags(shape, 1, times=1)
    args[args.index("--gateways") + 1] = "1"
    args += ["--concurrency", str(32 * shape["replicas"])]
    return run(args, os.path.join(out, "capacity"), ["kvgate"])["kvgate"]["requests_per_s"]


def run_cell(index, shape, args):
    out = os.path.join(args.out, f"c{index}")
    caps_from = args.caps_from or args.peers_from
    cap = capacity(shape, os.path.join(caps_from, f"c{index}") if caps_from else out)
    per_seed = []
    for seed in range(1, args.seeds + 1):
        arrivals = flags(shape, seed) + ["--rate", f"{shape['load'] * cap:.6g}"]
        s = run_seed(arrivals, os.path.join(out, f"seed{seed}"), args,
                     args.peers_from and os.path.join(args.peers_from, f"c{index}", f"seed{seed}"))
        best = min(grid.PEERS, key=lambda p: s[p]["ttft_s"]["p90"])
        cached = max(s[p]["cached_token_ratio"] for p in grid.PEERS)
        exchanged = s["kvgate"]
        if args.exchange_ms and shape["gateways"] > 1:
            exchanged = run(arrivals + ["--gateway-exchange-ms", str(args.exchange_ms)],
                            os.path.join(out, f"seed{seed}", "exchange"), ["kvgate"])["kvgate"]
        per_seed.append({
            "p90_over_best_peer": s["kvgate"]["ttft_s"]["p90"] / s[best]["ttft_s"]["p90"],
            "cached_over_best_peer": s["kvgate"]["cached_token_ratio"] / cached if cached else 1.0,
            "deployed_p90": exchanged["ttft_s"]["p90"] / s[best]["ttft_s"]["p90"],
            "deployed_cached": exchanged["cached_token_ratio"] / cached if cached else 1.0,
            "best_peer": best,
            "tries": {name_of(t): s[name_of(t)]["ttft_s"]["p90"] / s[best]["ttft_s"]["p90"]
                      for t in args.tries},
        })
    ratios = [r["p90_over_best_peer"] for r in per_seed]
    deployed = [r["deployed_p90"] for r in per_seed]
    return {
        "deployed": {
            "p90_over_best_peer": statistics.median(deployed),
            "per_seed": [round(r, 3) for r in deployed],
            "cached_over_best_peer": statistics.median(r["deployed_cached"] for r in per_seed),
        },
        "tries": {name_of(t): statistics.median(r["tries"][name_of(t)] for r in per_seed)
                  for t in args.tries},
        "shape": describe(shape),
        "p90_over_best_peer": statistics.median(ratios),
        "per_seed": [round(r, 3) for r in ratios],
        "cached_over_best_peer": statistics.median(r["cached_over_best_peer"] for r in per_seed),
        "best_peer": statistics.mode(r["best_peer"] for r in per_seed),
    }


def sum_up(p90, cached):
    return {
        "median": statistics.median(p90),
        "geometric_mean": statistics.geometric_mean(p90),
        "over_1_05": sum(r > 1.05 for r in p90),
        "over_1_25": sum(r > 1.25 for r in p90),
        "cached_under_0_95": sum(c < 0.95 for c in cached),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draw", type=int, default=2)
    ap.add_argument("--cells", type=int, default=100)
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(grid.ROOT, "target", "offgrid"))
    ap.add_argument("--caps-from")
    ap.add_argument("--kvgate", default=grid.KVGATE)
    ap.add_argument("--try", dest="tries", nargs="*", default=[], metavar="POLICY.yaml")
    ap.add_argument("--exchange-ms", type=int, default=None, metavar="MS")
    ap.add_argument("--peers-from", metavar="DIR")
    ap.add_argument("--times", type=int, default=1)
    args = ap.parse_args()
    grid.KVGATE = args.kvgate
    global TIMES
    TIMES = args.times
    os.makedirs(args.out, exist_ok=True)
    rng = random.Random(args.draw)
    shapes = [draw_shape(rng) for _ in range(args.cells)]
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as ex:
        futures = [ex.submit(run_cell, i, s, args) for i, s in enumerate(shapes)]
        cells = []
        for i, f in enumerate(futures):
            c = f.result()
            cells.append(c)
            tried = "".join(f" {t} {r:.2f}" for t, r in c["tries"].items())
            if args.exchange_ms and shapes[i]["gateways"] > 1:
                tried += f" exchange {c['deployed']['p90_over_best_peer']:.2f}"
            print(f"c{i:<3} {c['shape']:<72} {c['p90_over_best_peer']:.2f} {c['per_seed']} "
                  f"cached {c['cached_over_best_peer']:.2f} best {c['best_peer']}{tried}",
                  flush=True)
    summary = {
        "cells": len(cells),
        **sum_up([c["p90_over_best_peer"] for c in cells],
                 [c["cached_over_best_peer"] for c in cells]),
        "tries": {name_of(t): {"geometric_mean": statistics.geometric_mean(
                                   c["tries"][name_of(t)] for c in cells),
                               "over_1_25": sum(c["tries"][name_of(t)] > 1.25 for c in cells)}
                  for t in args.tries},
    }
    if args.exchange_ms:
        summary["deployed"] = sum_up([c["deployed"]["p90_over_best_peer"] for c in cells],
                                     [c["deployed"]["cached_over_best_peer"] for c in cells])
    print(json.dumps(summary))
    with open(os.path.join(args.out, "offgrid.json"), "w") as f:
        json.dump({"summary": summary, "cells": cells}, f, indent=1)


if __name__ == "__main__":
    main()
