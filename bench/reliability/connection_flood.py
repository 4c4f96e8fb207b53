#!/usr/bin/env python3
"""A flood of idle connections against a gateway whose open-file limit is small.

Starts the nginx backend and, per build, a gateway (`threads: 1`, text mode) under
`prlimit --nofile=FILES`; opens CONNECTIONS TCP connections to it that send nothing; then, a
second later, sends one chat request on a fresh connection and reports its answer and
latency; then how long the flood's connections were held, and whether the gateway serves again
once they close. Every process started stops with the script (by its PID).

Usage: bench/reliability/connection_flood.py [--files 512] [--connections 1000]
                                             LABEL=BINARY ...
"""
import argparse, http.client, json, os, socket, sys, tempfile, time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "proxy"))
from servers import Server, free_port  # noqa: E402
from run import HERE, gateway_config, nginx_conf  # noqa: E402

BODY = json.dumps({"model": "bench", "messages": [{"role": "user", "content": "hi"}]})


def ask(port):
    """(status or error, seconds) of one chat request on a fresh connection."""
    started = time.perf_counter()
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        c.request("POST", "/v1/chat/completions", BODY, {"Content-Type": "application/json"})
        r = c.getresponse()
        r.read()
        return r.status, time.perf_counter() - started
    except OSError as e:
        return type(e).__name__, time.perf_counter() - started


def flood(port, connections):
    """The flood's sockets; then, per socket, the seconds until the gateway closed it."""
    socks = []
    for _ in range(connections):
        s = socket.socket()
        try:
            s.connect(("127.0.0.1", port))
        except OSError:
            s.close()
            break
        socks.append(s)
    return socks


def held(socks, started, limit=90):
    """Seconds each socket stayed open (from `started`), and the first bytes it got."""
    out = []
    for s in socks:
        s.settimeout(max(0.1, started + limit - time.time()))
        try:
            got = s.recv(64)
        except OSError:
            got = b"(still open)"
        out.append((time.time() - started, got.split(b"\r\n")[0].decode(errors="replace")))
        s.close()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("builds", nargs="+", metavar="LABEL=BINARY")
    ap.add_argument("--files", type=int, default=512)
    ap.add_argument("--connections", type=int, default=1000)
    args = ap.parse_args()
    os.environ.setdefault("KVGATE_LOG", "warn")
    tmp = tempfile.mkdtemp(prefix="kvgate-flood-")
    servers = []
    try:
        backend = free_port()
        conf = nginx_conf(tmp, "backend", open(os.path.join(HERE, "backend.conf.in")).read()
                          .replace("@PORT@", str(backend)), 1)
        servers.append(Server("backend", ["/usr/sbin/nginx", "-c", conf], backend, tmp))
        print(f"{args.connections} idle connections, open-file limit {args.files}\n")
        print("| build | a request beside the flood | flood connections closed within 5 s "
              "/ 35 s / held longer | first bytes they got | a request after |")
        print("|---|---|---:|---|---|")
        for build in args.builds:
            label, binary = build.split("=", 1)
            port = free_port()
            path = gateway_config(os.path.join(tmp, f"{label}.yaml"), port, 1, backend, False)
            g = Server(label, ["prlimit", f"--nofile={args.files}:{args.files}", binary,
                              "gateway", "--config", path], port, tmp)
            servers.append(g)
            socks = flood(port, args.connections)
            started = time.time()
            time.sleep(1)
            status, seconds = ask(port)
            times = held(socks, started)
            after = ask(port)
            within = lambda t: sum(1 for s, _ in times if s <= t)  # noqa: E731
            firsts = sorted({f for _, f in times})
            print(f"| {label} | {status} in {seconds:.2f} s | {within(5)} / {within(35)} / "
                  f"{len(times) - within(35)} | {', '.join(firsts)} | {after[0]} in "
                  f"{after[1] * 1000:.1f} ms |", flush=True)
            g.stop()
    finally:
        for s in reversed(servers):
            s.stop()


if __name__ == "__main__":
    main()
