#!/usr/bin/env python3
"""The oracle's bound, checked over a grid of workload shapes in `kvgate sim`: for each cell,
every policy on the same arrivals, whether any beat the oracle's mean, P50 or P90 TTFT, and how
far below the best policy's each of the oracle's figures is (what its search found beyond the
policies' own routes).

4 replicas of 4,096 KV blocks (H200 / Llama-3.1-8B profile): shared-prefix with 1, 4, 16 and
64 groups, 512- and 2,048-token system prompts, at 20, 60 and 120 req/s; multi-turn sessions
at 4, 16 and 48 concurrent; random prompts at 10 and 40 req/s; the Mooncake synthetic and
conversation traces (first 800 requests, 64-token blocks, 8x their rate).

Usage: bench/routing/oracle_grid.py [--out DIR]
Prints one line per cell (what beat the oracle, or ok; the oracle over the best policy per
figure) and the count per metric.
"""
import argparse, itertools, json, os, subprocess, sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KVGATE = os.path.join(ROOT, "target", "release", "kvgate")
TRACES = os.path.join(ROOT, "..", "shared", "traces")
POLICIES = ["oracle", "kvgate", "cache-first", "round-robin", "least-load", "sglang-cache-aware",
            "vllm-consistent-hash", "llm-d", "dynamo", "soonest-first-token"]


def cells():
    for groups, rate, system in itertools.product([1, 4, 16, 64], [20, 60, 120], [512, 2048]):
        yield (f"shared-prefix {groups} groups, {system}-token system, {rate}/s",
               ["--workload", "shared-prefix", "--groups", str(groups),
                "--prompts-per-group", str(max(1, 400 // groups)), "--system-len", str(system),
                "--question-len", "64", "--output-len", "32", "--rate", str(rate),
                "--requests", "400"])
    for c in [4, 16, 48]:
        yield (f"multi-turn, {c} concurrent",
               ["--workload", "multi-turn", "--turns", "6", "--system-len", "512",
                "--turn-len", "96", "--output-len", "48", "--concurrency", str(c),
                "--requests", "300"])
    for r in [10, 40]:
        yield (f"random, {r}/s", ["--workload", "random", "--input-mean", "1500",
                                  "--output-mean", "100", "--rate", str(r), "--requests", "300"])
    for trace in ["synthetic_trace.jsonl", "conversation_trace.jsonl"]:
        yield (f"mooncake {trace}", ["--workload", f"mooncake:{os.path.join(TRACES, trace)}",
                                     "--block-tokens", "64", "--requests", "800",
                                     "--time-scale", "8"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/kvgate-oracle-grid")
    args = ap.parse_args()
    subprocess.run(["cargo", "build", "--release", "--bin", "kvgate"], cwd=ROOT, check=True)
    broken = {"mean": 0, "p50": 0, "p90": 0}
    gains = {q: [] for q in broken}
    for i, (name, cell) in enumerate(cells()):
        out = os.path.join(args.out, str(i))
        cmd = [KVGATE, "sim", "--replicas", "4", "--num-blocks", "4096", "--max-model-len",
               "16384", "--quiet", "--out", out, *cell]
        for p in POLICIES:
            cmd += ["--policy", p]
        subprocess.run(cmd, check=True, capture_output=True)
        ttft = {p: json.load(open(os.path.join(out, p, "summary.json")))["ttft_s"] for p in POLICIES}
        beaten, ratios = [], []
        for q in broken:
            best, who = min((ttft[p][q], p) for p in POLICIES if p != "oracle")
            ratios.append(f"{q} {ttft['oracle'][q] / best:.3f} of {who}'s")
            gains[q].append(ttft["oracle"][q] / best)
            if best < ttft["oracle"][q]:
                broken[q] += 1
                beaten.append(f"{q} {who} {best * 1e3:.1f} < {ttft['oracle'][q] * 1e3:.1f} ms")
        print(f"{i:2} {name}: {'; '.join(beaten) or 'ok'} ({', '.join(ratios)})", flush=True)
    print(f"cells beaten on each metric: {broken}")
    for q, g in gains.items():
        print(f"oracle over the best policy, {q}: median {sorted(g)[len(g) // 2]:.3f}, "
              f"lowest {min(g):.3f}")


if __name__ == "__main__":
    sys.exit(main())
