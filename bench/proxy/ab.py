#!/usr/bin/env python3
"""kvgate builds and thread counts against each other alone, in front of the same nginx backend,
in an order rotated one place per round (on a shared VM a fixed order gives one of them a
steady edge). Per config and round: throughput at 64 connections, and at one connection the
p50, CPU and wake-ups per request, as bench/proxy/run.py measures them.

Usage: bench/proxy/ab.py [--seconds 3] [--rounds 4] [--shape 200B] [--mode text|token]
                         [--out DIR] LABEL=BINARY:THREADS ...
e.g. bench/proxy/ab.py before=/tmp/kvgate-before:2 after=target/release/kvgate:2
A BINARY named `nginx` runs nginx as the proxy (THREADS worker processes), the peer to name
beside the builds.
"""
import argparse, os, shutil, statistics, sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run import (HERE, SHAPES, fixed_backend, gateway_config, nginx_conf, nginx_proxy,  # noqa: E402
                 save, wrk, wrk_script)
from servers import Server, free_port, prepare  # noqa: E402


def gateway(tmp, label, binary, threads, backend, mode):
    port = free_port()
    if os.path.basename(binary) == "nginx":
        conf = nginx_conf(tmp, label, nginx_proxy(port, backend), threads)
        return Server(label, [shutil.which(binary) or "/usr/sbin/nginx", "-c", conf], port, tmp)
    path = gateway_config(os.path.join(tmp, f"{label}.yaml"), port, threads, backend,
                          mode == "token")
    return Server(label, [binary, "gateway", "--config", path], port, tmp)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("configs", nargs="+", metavar="LABEL=BINARY:THREADS")
    ap.add_argument("--seconds", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--shape", default="200B", choices=[s for s in SHAPES if s != "stream64"])
    ap.add_argument("--mode", default="text", choices=["text", "token"])
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    os.environ.setdefault("KVGATE_LOG", "warn")
    tmp = prepare("proxy-ab", args.out)
    servers = []
    try:
        servers.append(fixed_backend(tmp, "backend", 1))
        backend = servers[0].port
        gateways = {}
        for c in args.configs:
            label, rest = c.split("=", 1)
            binary, threads = rest.rsplit(":", 1)
            gateways[label] = gateway(tmp, label, binary, int(threads), backend, args.mode)
            servers.append(gateways[label])
        script = wrk_script(args.shape, tmp)
        runs = {label: [] for label in gateways}
        order = list(gateways)
        for r in range(args.rounds):
            for label in order[r % len(order):] + order[:r % len(order)]:
                s = gateways[label]
                url = f"http://127.0.0.1:{s.port}/v1/chat/completions"
                one = wrk(url, script, 1, 1, args.seconds, s.proc.pid)
                many = wrk(url, script, 2, 64, args.seconds)
                runs[label].append({**one, "rps": many["rps"]})
        lines = [f"{args.shape}, {args.mode} mode, {args.seconds} s x {args.rounds} rounds "
                 "(median, then each round in the order run):", "",
                 "| config | req/s (64 conns) | p50 µs | CPU µs/req | wake-ups/req |",
                 "|---|---:|---:|---:|---:|"]
        for label, rs in runs.items():
            cell = lambda k, f: f"{statistics.median(r[k] for r in rs):{f}} ({', '.join(f'{r[k]:{f}}' for r in rs)})"  # noqa: E731,E501
            lines.append(f"| {label} | {cell('rps', '.0f')} | {cell('p50', '.0f')} | "
                         f"{cell('cpu_us', '.0f')} | {cell('wakeups', '.2f')} |")
        lines += ["", f"Per round against {order[0]} (a shared VM's speed drifts between rounds; "
                  "ratios within a round do not): median [range]", "",
                  "| config | req/s ratio | p50 µs added | CPU µs/req added |", "|---|---:|---:|---:|"]
        base = runs[order[0]]
        for label in order[1:]:
            rs = runs[label]
            ratio = [r["rps"] / b["rps"] for r, b in zip(rs, base)]
            diff = lambda k: [r[k] - b[k] for r, b in zip(rs, base)]  # noqa: E731
            span = lambda xs, f: f"{statistics.median(xs):{f}} [{min(xs):{f}} to {max(xs):{f}}]"  # noqa: E731
            lines.append(f"| {label} | {span(ratio, '.2f')} | {span(diff('p50'), '+.0f')} | "
                         f"{span(diff('cpu_us'), '+.0f')} |")
        print("\n".join(lines))
        save(args.out, f"ab-{args.shape}-{args.mode}", "\n".join(lines),
             {"configs": args.configs, "runs": runs})
    finally:
        for s in reversed(servers):
            s.stop()


if __name__ == "__main__":
    main()
