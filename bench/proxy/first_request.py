#!/usr/bin/env python3
"""A freshly started proxy's first requests: what a start, a restart or a graceful upgrade
costs the requests that meet it. Each round starts every proxy anew in front of one nginx
backend, waits for its health checks to settle, and sends requests one at a time, each on a
new connection (so that, with several threads, they land on each), timing each.

Usage: bench/proxy/first_request.py [--rounds 5] [--requests 8] [--threads 2]
                                    [--mode text|token] [--out DIR] LABEL=BINARY ...
A BINARY named `nginx` runs nginx as the proxy (the peer); any other is a kvgate build.
"""
import argparse, os, statistics, sys, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab import gateway  # noqa: E402
from run import HERE, fixed_backend, save  # noqa: E402
from servers import post, prepare  # noqa: E402

BODY = {"model": "bench", "messages": [{"role": "user", "content": "say ok."}], "max_tokens": 8}


def timed_request(port):
    """One request on a new connection, in ms."""
    start = time.perf_counter()
    with post(port, "/v1/chat/completions", BODY, timeout=10) as answer:
        answer.read()
    return (time.perf_counter() - start) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("configs", nargs="+", metavar="LABEL=BINARY")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mode", default="text", choices=["text", "token"])
    ap.add_argument("--settle", type=float, default=1.5, help="seconds after it is healthy")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    tmp = prepare("proxy-first-request", args.out)
    servers = []
    try:
        servers.append(fixed_backend(tmp, "backend", 1))
        backend = servers[0].port
        times = {c.split("=", 1)[0]: [] for c in args.configs}
        for r in range(args.rounds):
            for c in args.configs:
                label, binary = c.split("=", 1)
                proxy = gateway(tmp, f"{label}-{r}", binary, args.threads, backend, args.mode)
                try:
                    time.sleep(args.settle)
                    times[label].append([timed_request(proxy.port) for _ in range(args.requests)])
                finally:
                    proxy.stop()
        first = args.threads
        lines = [f"{args.rounds} rounds, {args.requests} requests a start, each on a new "
                 f"connection, {args.threads} threads or workers, {args.mode} mode; ms", "",
                 f"| proxy | slowest of the first {first} (median over rounds) | the rest, median "
                 "| every round's first requests |", "|---|---:|---:|---|"]
        for label, rounds in times.items():
            slowest = statistics.median(max(t[:first]) for t in rounds)
            rest = statistics.median(x for t in rounds for x in t[first:])
            each = "; ".join(" ".join(f"{x:.1f}" for x in t[:first]) for t in rounds)
            lines.append(f"| {label} | {slowest:.1f} | {rest:.1f} | {each} |")
        print("\n".join(lines))
        save(args.out, "first-request", "\n".join(lines), {"configs": args.configs, "times": times})
    finally:
        for s in reversed(servers):
            s.stop()


if __name__ == "__main__":
    main()
