#!/usr/bin/env python3
"""The offload tiers' worth on the CPU backend: time to first token of a prompt whose long
prefix (4k tokens by default) was computed before and then evicted from the KV cache by another
prompt, served from the host tier, or from the disk tier (under a host tier of 1 MiB, which
keeps 2 of its blocks), against computed again (the same worker without a tier), with a
device-cache hit beside them. The KV cache holds one such prompt, so the second prompt evicts
the first's every block. Each round uses fresh prompts and rotates the modes' order; the table
gives each mode's median TTFT and recompute's over each tier's, per round.

Usage: bench/offload/run.py [--prefix-tokens 4096] [--rounds 3] [--threads 1]
Needs `cargo build --release --bin kvgate` (done here). Every worker started here runs in a
session of its own and is stopped by its PID, also when the script is interrupted or fails.
"""
import argparse, json, os, random, statistics, sys, time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from servers import ROOT, Server, free_port, prepare, stream  # noqa: E402

BLOCK = 16
SUFFIX = 8
MAX_TOKENS = 2


def ttft(port, prompt):
    """Seconds from sending a streamed completion to its first token, and its cached tokens."""
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    started, first, cached = time.perf_counter(), None, None
    for data in stream(port, "/v1/completions", body):
        if first is None and any(c.get("text") is not None for c in data.get("choices", [])):
            first = time.perf_counter() - started
        if data.get("usage"):
            cached = data["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return first, cached


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix-tokens", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "offload", "results"))
    args = ap.parse_args()
    logs = prepare("offload", args.out)
    prompt_len = args.prefix_tokens + SUFFIX
    blocks = -(-(prompt_len + MAX_TOKENS) // BLOCK)
    # Exactly one prompt's blocks: the second prompt evicts the first's.
    kv_mib = blocks * BLOCK * 46 * 1024 // (1 << 20) + 8
    worker = lambda *extra: ["target/release/kvgate", "worker", "--backend", "cpu", "--threads",
                             str(args.threads), "--kv-cache-mib", str(kv_mib), "--num-blocks",
                             str(blocks), "--max-model-len", str(blocks * BLOCK),
                             "--served-model-name", "smollm2", *extra]
    disk_dir = os.path.join(logs, "disk-tier")
    modes = [("recompute", worker()),
             ("host tier", worker("--kv-offload-mib", str(2 * kv_mib))),
             ("disk tier", worker("--kv-offload-mib", "1", "--kv-offload-dir", disk_dir,
                                  "--kv-offload-disk-mib", str(2 * kv_mib)))]
    rng = random.Random(7)
    rows = []
    for rnd in range(args.rounds):
        prefix = [rng.randrange(200, 40_000) for _ in range(args.prefix_tokens)]
        other = [rng.randrange(200, 40_000) for _ in range(prompt_len)]
        ask = lambda: prefix + [rng.randrange(200, 40_000) for _ in range(SUFFIX)]
        turn = rnd % len(modes)
        for name, cmd in modes[turn:] + modes[:turn]:
            port = free_port()
            server = Server(name.replace(" ", "-"), [*cmd, "--port", str(port)], port, logs)
            try:
                cold, _ = ttft(port, ask())
                hit, hit_cached = ttft(port, ask())
                ttft(port, other)
                back, back_cached = ttft(port, ask())
            finally:
                server.stop()
            row = dict(round=rnd + 1, mode=name, cold_s=round(cold, 4), device_hit_s=round(hit, 4),
                       device_hit_cached=hit_cached, after_eviction_s=round(back, 4),
                       after_eviction_cached=back_cached)
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(table(rows, args.prefix_tokens))


def table(rows, prefix_tokens):
    """Markdown: each mode's median TTFT after eviction (cold and device hit beside it), and
    recompute's over the host tier's per round."""
    med = lambda mode, key: statistics.median(r[key] for r in rows if r["mode"] == mode)
    lines = [f"| {prefix_tokens}-token prefix | cold TTFT | device hit | after eviction | cached after eviction |",
             "|---|---:|---:|---:|---:|"]
    for mode in dict.fromkeys(r["mode"] for r in rows):
        cached = sorted({r["after_eviction_cached"] for r in rows if r["mode"] == mode})
        lines.append(f"| {mode} | {med(mode, 'cold_s') * 1e3:.1f} ms | {med(mode, 'device_hit_s') * 1e3:.1f} ms"
                     f" | {med(mode, 'after_eviction_s') * 1e3:.1f} ms | {'/'.join(map(str, cached))} |")
    for tier in ("host tier", "disk tier"):
        ratios = []
        for rnd in sorted({r["round"] for r in rows}):
            got = {r["mode"]: r["after_eviction_s"] for r in rows if r["round"] == rnd}
            if "recompute" in got and tier in got:
                ratios.append(got["recompute"] / got[tier])
        if ratios:
            lines.append("")
            lines.append(f"recompute / {tier} after eviction: median {statistics.median(ratios):.1f}x "
                         f"[{' '.join(f'{x:.1f}' for x in ratios)}]")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
