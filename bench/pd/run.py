#!/usr/bin/env python3
"""When prefill/decode disaggregation pays: the same workers behind a kvgate gateway,
colocated (every worker serves requests whole) against disaggregated (half of them
`--role prefill`, half `--role decode`, the gateway's `disaggregation:` pool with vLLM's
hand-over), on the same closed-loop load from `kvgate bench` (the random workload, two
requests in flight per worker), at each fleet size and prompt length. Reports each cell's
ITL P99 and TTFT P90 and disaggregated over colocated, and draws the ratios against prompt
length (crossover.svg).

Backends: `cpu` (SmolLM2 on the CPU backend, 1 thread each; the blocks travel over loopback
TCP), `sim` (real processes on the sim backend, the H200 / Llama-3.1-8B profile, slowed by
--time-scale so that the fleet, gateway and load generator share this machine; figures are
given in the profile's time) and `kvgate-sim` (the same fleets in `kvgate sim`'s virtual time,
`--prefill-replicas`; no processes, so larger fleets).

Usage: bench/pd/run.py [--backend sim|cpu|kvgate-sim] [--sizes 2,4] [--prompts 256,8192]
                       [--output 128] [--requests 120] [--time-scale 4] [--out DIR]
"""
import argparse, json, os, subprocess, sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from servers import ROOT, Server, free_port, prepare  # noqa: E402

KVGATE = os.path.join(ROOT, "target", "release", "kvgate")
MODEL = "smollm2"


def worker_cmd(args, port, role):
    cmd = [KVGATE, "worker", "--backend", args.backend, "--port", str(port),
           "--served-model-name", MODEL]
    if args.backend == "cpu":
        cmd += ["--threads", "1", "--kv-cache-mib", "512", "--max-model-len", "4096"]
    else:
        # Modelled blocks hold no bytes: a host tier as large as the device's KV cache.
        cmd += ["--time-scale", str(args.time_scale), "--max-model-len", "32768"]
        if role == "decode":
            cmd += ["--kv-offload-mib", str(64 << 10)]
    if role:
        cmd += ["--role", role]
    return cmd


def start_fleet(args, mode, size, logs, servers):
    """The workers and a gateway in front of them; returns the gateway's port."""
    roles = [None] * size if mode == "colocated" else (
        ["prefill"] * (size // 2) + ["decode"] * (size - size // 2))
    replicas = []
    for i, role in enumerate(roles):
        port = free_port()
        servers.append(Server(f"{mode}-{size}-{i}", worker_cmd(args, port, role), port, logs))
        labels = f'{{{role}: "yes"}}' if role else "{}"
        replicas.append(f'  - url: "http://127.0.0.1:{port}"\n    labels: {labels}\n')
    gateway, admin = free_port(), free_port()
    yaml = (f'listen: "127.0.0.1:{gateway}"\nadmin_listen: "127.0.0.1:{admin}"\n'
            "timeouts: {first_byte_ms: 600000}\nreplicas:\n" + "".join(replicas))
    if mode == "disaggregated":
        yaml += ("disaggregation:\n  pools:\n    - flow: vllm\n"
                 '      prefill: {prefill: "yes"}\n      decode: {decode: "yes"}\n')
    config = os.path.join(logs, f"gateway-{mode}-{size}.yaml")
    with open(config, "w") as f:
        f.write(yaml)
    servers.append(Server(f"gateway-{mode}-{size}", [KVGATE, "gateway", "--config", config],
                          gateway, logs))
    return gateway


def bench(args, port, size, prompt, out):
    subprocess.run([KVGATE, "bench", "--url", f"http://127.0.0.1:{port}", "--model", MODEL,
                    "--workload", "random", "--input-mean", str(prompt), "--input-sigma", "0.25",
                    "--output-mean", str(args.output), "--output-sigma", "0.1",
                    "--concurrency", str(2 * size), "--requests", str(args.requests),
                    "--warmup", str(max(2, args.requests // 15)), "--seed", "1", "--quiet",
                    "--out", out], check=True)
    with open(os.path.join(out, "summary.json")) as f:
        s = json.load(f)
    scale = args.time_scale if args.backend == "sim" else 1.0
    return {"itl_p99_ms": 1e3 * s["itl_s"]["p99"] / scale,
            "ttft_p90_ms": 1e3 * s["ttft_s"]["p90"] / scale,
            "itl_p50_ms": 1e3 * s["itl_s"]["p50"] / scale,
            "output_tok_s": s["output_tokens_per_s"] * scale,
            "failed": s["failed"], "cached_ratio": s["cached_token_ratio"]}


def simulate(args, mode, size, prompt, out):
    """The cell in `kvgate sim`: the same fleet, load and workload, in virtual time."""
    prefill = size // 2 if mode == "disaggregated" else 0
    subprocess.run([KVGATE, "sim", "--replicas", str(size), "--prefill-replicas", str(prefill),
                    "--max-model-len", "32768", "--workload", "random",
                    "--input-mean", str(prompt), "--input-sigma", "0.25",
                    "--output-mean", str(args.output), "--output-sigma", "0.1",
                    "--concurrency", str(2 * size), "--requests", str(args.requests),
                    "--warmup", str(max(2, args.requests // 15)), "--seed", "1",
                    "--policy", "kvgate", "--quiet", "--out", out], check=True,
                   stdout=subprocess.DEVNULL)
    with open(os.path.join(out, "kvgate", "summary.json")) as f:
        s = json.load(f)
    return {"itl_p99_ms": 1e3 * s["itl_s"]["p99"], "ttft_p90_ms": 1e3 * s["ttft_s"]["p90"],
            "itl_p50_ms": 1e3 * s["itl_s"]["p50"], "output_tok_s": s["output_tokens_per_s"],
            "failed": s["failed"], "cached_ratio": s["cached_token_ratio"]}


def plot(rows, path):
    """ITL P99 and TTFT P90, disaggregated over colocated, against prompt length, per size."""
    w, h, pad = 640, 360, 50
    prompts = sorted({r["prompt"] for r in rows})
    ratios = [r[k] for r in rows for k in ("itl_ratio", "ttft_ratio")]
    top = max(2.0, max(ratios) * 1.1)
    x = lambda p: pad + (w - 2 * pad) * prompts.index(p) / max(1, len(prompts) - 1)
    y = lambda v: h - pad - (h - 2 * pad) * v / top
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-size="11">',
           f'<text x="{w / 2}" y="18" text-anchor="middle">disaggregated / colocated '
           '(below 1: disaggregation pays)</text>',
           f'<line x1="{pad}" y1="{y(1)}" x2="{w - pad}" y2="{y(1)}" stroke="#999" '
           'stroke-dasharray="4"/>']
    for p in prompts:
        out.append(f'<text x="{x(p)}" y="{h - pad + 16}" text-anchor="middle">{p}</text>')
    out.append(f'<text x="{w / 2}" y="{h - 12}" text-anchor="middle">prompt tokens</text>')
    for v in (0.5, 1.0, 1.5, top):
        out.append(f'<text x="{pad - 6}" y="{y(v) + 4}" text-anchor="end">{v:.1f}</text>')
    colours = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
    for i, size in enumerate(sorted({r["size"] for r in rows})):
        mine = sorted((r for r in rows if r["size"] == size), key=lambda r: r["prompt"])
        for key, dash, name in (("itl_ratio", "", "ITL P99"), ("ttft_ratio", "5,3", "TTFT P90")):
            pts = " ".join(f"{x(r['prompt'])},{y(r[key])}" for r in mine)
            out.append(f'<polyline points="{pts}" fill="none" stroke="{colours[i % 4]}" '
                       f'stroke-dasharray="{dash}" stroke-width="2"/>')
            ly = 40 + 14 * (2 * i + (key == "ttft_ratio"))
            out.append(f'<text x="{w - pad - 150}" y="{ly}" fill="{colours[i % 4]}">'
                       f'{size} workers, {name}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", choices=["sim", "cpu", "kvgate-sim"], default="sim")
    ap.add_argument("--sizes", default="2,4")
    ap.add_argument("--prompts", default="256,8192")
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--time-scale", type=float, default=4.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = args.out or os.path.join(ROOT, "bench", "pd", "results", args.backend)
    logs = prepare(f"pd-{args.backend}", out)
    rows = []
    for size in [int(s) for s in args.sizes.split(",")]:
        for prompt in [int(p) for p in args.prompts.split(",")]:
            cell = {"size": size, "prompt": prompt}
            for mode in ("colocated", "disaggregated"):
                if args.backend == "kvgate-sim":
                    cell[mode] = simulate(args, mode, size, prompt,
                                          os.path.join(out, f"{mode}-{size}-{prompt}"))
                    continue
                servers = []
                try:
                    port = start_fleet(args, mode, size, logs, servers)
                    cell[mode] = bench(args, port, size, prompt,
                                       os.path.join(out, f"{mode}-{size}-{prompt}"))
                finally:
                    for s in reversed(servers):
                        s.stop()
            cell["itl_ratio"] = cell["disaggregated"]["itl_p99_ms"] / cell["colocated"]["itl_p99_ms"]
            cell["ttft_ratio"] = (cell["disaggregated"]["ttft_p90_ms"]
                                  / cell["colocated"]["ttft_p90_ms"])
            rows.append(cell)
            print(json.dumps(cell), flush=True)
    with open(os.path.join(out, "cells.json"), "w") as f:
        json.dump(rows, f, indent=1)
    plot(rows, os.path.join(out, "crossover.svg"))
    print("| workers | prompt | ITL P99 colocated | disaggregated | ratio | TTFT P90 colocated "
          "| disaggregated | ratio | out tok/s colocated | disaggregated |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        c, d = r["colocated"], r["disaggregated"]
        print(f"| {r['size']} | {r['prompt']} | {c['itl_p99_ms']:.1f} ms | {d['itl_p99_ms']:.1f} ms "
              f"| {r['itl_ratio']:.2f} | {c['ttft_p90_ms']:.0f} ms | {d['ttft_p90_ms']:.0f} ms "
              f"| {r['ttft_ratio']:.2f} | {c['output_tok_s']:.0f} | {d['output_tok_s']:.0f} |")


if __name__ == "__main__":
    main()
