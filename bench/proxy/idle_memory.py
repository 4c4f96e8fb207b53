#!/usr/bin/env python3
"""Memory a gateway holds for each idle keep-alive connection: N clients each send one
`GET /health`, read the answer and stay connected; the gateway's resident set is read before
and after. Builds run in turn, rounds rotated, in front of the same nginx backend.

Usage: bench/proxy/idle_memory.py [--connections 3000] [--rounds 2] [--out DIR] LABEL=BINARY ...
e.g. bench/proxy/idle_memory.py before=/tmp/kvgate-before after=target/release/kvgate
"""
import argparse, os, resource, socket, statistics, sys, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab import gateway  # noqa: E402
from run import HERE, fixed_backend, save  # noqa: E402
from servers import prepare  # noqa: E402

HEALTH = b"GET /health HTTP/1.1\r\nHost: kvgate\r\n\r\n"


def resident_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


def answered(sock):
    """Reads one small answer whole (its header says how long its body is)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            raise RuntimeError("the gateway closed an idle connection")
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(4096)


def bytes_per_connection(server, connections):
    before = resident_kib(server.proc.pid)
    socks = []
    try:
        for _ in range(connections):
            s = socket.create_connection(("127.0.0.1", server.port))
            socks.append(s)
            s.sendall(HEALTH)
        for s in socks:
            answered(s)
        time.sleep(0.5)
        return (resident_kib(server.proc.pid) - before) * 1024 / connections
    finally:
        for s in socks:
            s.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("configs", nargs="+", metavar="LABEL=BINARY")
    ap.add_argument("--connections", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < args.connections + 100:
        sys.exit(f"--connections {args.connections} needs more open files than {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    os.environ.setdefault("KVGATE_LOG", "warn")
    tmp = prepare("idle-memory", args.out)
    configs = [c.split("=", 1) for c in args.configs]
    figures = {label: [] for label, _ in configs}
    backend = fixed_backend(tmp, "backend", 1)
    try:
        for r in range(args.rounds):
            for label, binary in configs[r % len(configs):] + configs[:r % len(configs)]:
                server = gateway(tmp, f"{label}-{r}", binary, 2, backend.port, "text")
                try:
                    figures[label].append(bytes_per_connection(server, args.connections))
                finally:
                    server.stop()
    finally:
        backend.stop()
    lines = [f"{args.connections} idle keep-alive connections, {args.rounds} rounds:", "",
             "| config | bytes a connection (median) | rounds |", "|---|---:|---|"]
    for label, values in figures.items():
        rounds = ", ".join(f"{v:.0f}" for v in values)
        lines.append(f"| {label} | {statistics.median(values):.0f} | {rounds} |")
    table = "\n".join(lines)
    print(table)
    save(args.out, "idle-memory", table, figures)


if __name__ == "__main__":
    main()
