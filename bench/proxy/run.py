#!/usr/bin/env python3
"""The gateway's hot path against the proxies it replaces, side by side on loopback: kvgate (text
and token mode), nginx, SGLang's router and vLLM's router in front of the same backends.

For every request shape: added latency at one connection (p50, p99), throughput at 64
connections, and per request the proxy's CPU time and its wake-ups (voluntary context switches
of all its threads and child processes); for streams also the delay each proxy adds to every
chunk (the backend stamps each chunk with the time it sent it).

Shapes: chat requests of about 200 B, 1 KB, 8 KB and 64 KB (a system prompt shared by every
request and a user message that changes with each, so token mode tokenizes each one), answered
with fixed JSON by nginx; and streamed answers of 64 chunks from `kvgate fault-worker`.

Every proxy is a process of its own with one worker thread (`threads: 1`, `worker_processes
1`), as the backends are. Peers come from bench/peers/install.

Usage: bench/proxy/run.py [--seconds N] [--rounds N] [--shapes 200B,1KB,8KB,64KB,stream64]
                          [--threads N] [--before LABEL=BINARY] [--out DIR]
"""
import argparse, json, os, platform, random, re, shutil, socket, statistics, subprocess, sys, time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from servers import ROOT, Server, free_port, prepare  # noqa: E402

HERE = os.path.join(ROOT, "bench", "proxy")
PEERS = os.environ.get("KVGATE_PEERS", "/tmp/kvgate-peers")
KVGATE = os.path.join(ROOT, "target", "release", "kvgate")
MODEL_FILE = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
SHAPES = {"200B": 0, "1KB": 1024, "8KB": 8 << 10, "64KB": 64 << 10, "stream64": 0}
STREAM_CHUNKS = 64
WORDS = ("the model answers questions about the system it runs on and keeps every reply short "
         "clear and polite while it explains each step of the work in plain words for a reader "
         "who knows little about servers networks caches or the tools that measure them").split()


def filler(size, seed=7):
    """About `size` bytes of plain words, the same for every request of a shape."""
    rng, out, n = random.Random(seed), [], 0
    while n < size:
        w = rng.choice(WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)


def body_parts(shape):
    """The JSON body before and after the request counter (wrk puts a fresh one in each)."""
    stream = shape.startswith("stream")
    system = filler(SHAPES[shape]) if SHAPES[shape] else "You are a helpful assistant."
    user_tail = " ".join(f"w{i}" for i in range(STREAM_CHUNKS)) if stream else "say ok."
    head = json.dumps({"model": "bench", "messages": [{"role": "system", "content": system},
                                                      {"role": "user", "content": "@@"}]})
    head, tail = head.split("@@")
    extra = f', "max_tokens": {STREAM_CHUNKS}, "stream": true' if stream else ', "max_tokens": 8'
    return head + "Question ", f": {user_tail}" + tail[:-1] + extra + "}"


def wrk_script(shape, tmp):
    head, tail = body_parts(shape)
    path = os.path.join(tmp, f"{shape}.lua")
    with open(path, "w") as f:
        f.write('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
                f"local head = [==[{head}]==]\nlocal tail = [==[{tail}]==]\nlocal n = 0\n"
                "request = function()\n  n = n + 1\n"
                "  return wrk.format(nil, nil, nil, head .. n .. tail)\nend\n")
    return path


def tree(pid):
    """A process and all its descendants."""
    children = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                ppid = int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(p))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def usage(pid):
    """(CPU seconds, voluntary context switches) of a process tree, all threads."""
    cpu, switches, tick = 0.0, 0, os.sysconf("SC_CLK_TCK")
    for p in tree(pid):
        try:
            fields = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
            cpu += (int(fields[11]) + int(fields[12])) / tick
            for t in os.listdir(f"/proc/{p}/task"):
                for line in open(f"/proc/{p}/task/{t}/status"):
                    if line.startswith("voluntary_ctxt_switches"):
                        switches += int(line.split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return cpu, switches


def wrk(url, script, threads, conns, seconds, pid=None):
    before = usage(pid) if pid else None
    out = subprocess.run(["wrk", f"-t{threads}", f"-c{conns}", f"-d{seconds}s", "--latency",
                          "-s", script, url], capture_output=True, text=True, check=True).stdout
    after = usage(pid) if pid else None
    requests = int(re.search(r"(\d+) requests in", out).group(1))

    def pct(p):
        v, unit = re.search(rf"^\s+{p}%\s+([\d.]+)(us|ms|s)\s*$", out, re.M).groups()
        return float(v) * {"us": 1, "ms": 1e3, "s": 1e6}[unit]
    if re.search(r"Non-2xx or 3xx responses: (\d+)", out) or "Socket errors" in out:
        raise SystemExit(f"{url} answered errors:\n{out}")
    r = {"rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)),
         "p50": pct(50), "p99": pct(99)}
    if before:
        r["cpu_us"] = (after[0] - before[0]) * 1e6 / max(requests, 1)
        r["wakeups"] = (after[1] - before[1]) / max(requests, 1)
    return r


def chunk_delays(port, shape, requests):
    """Per chunk: the wall clock when it arrived here less when the backend sent it (µs)."""
    head, tail = body_parts(shape)
    delays = []
    for i in range(requests):
        body = (head + str(i) + tail).encode()
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: "
                      b"application/json\r\nConnection: close\r\nContent-Length: "
                      + str(len(body)).encode() + b"\r\n\r\n" + body)
            seen = b""
            while b"[DONE]" not in seen:
                data = s.recv(1 << 16)
                now = time.time_ns()
                if not data:
                    break
                seen = seen[-64:] + data
                delays += [(now - int(t)) / 1e3 for t in re.findall(rb"sent_ns=(\d+)", data)]
    return delays


def set_pace(port, ms):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/fault",
                                 data=json.dumps({"token_delay_ms": ms}).encode(),
                                 headers={"content-type": "application/json"})
    urllib.request.urlopen(req, timeout=5).read()


def nginx_conf(tmp, name, server_block, workers=1):
    path = os.path.join(tmp, f"{name}.conf")
    with open(path, "w") as f:
        f.write(open(os.path.join(HERE, "nginx.conf.in")).read()
                .replace("@DIR@", tmp).replace("@NAME@", name).replace("@WORKERS@", str(workers))
                .replace("@SERVER@", server_block))
    return path


def fixed_backend(tmp, name, workers):
    """nginx answering every request with fixed JSON on a port of its own, started."""
    port = free_port()
    conf = nginx_conf(tmp, name, open(os.path.join(HERE, "backend.conf.in")).read()
                      .replace("@PORT@", str(port)), workers)
    return Server(name, [shutil.which("nginx") or "/usr/sbin/nginx", "-c", conf], port, tmp)


def nginx_proxy(port, backend):
    """The server block of nginx as a proxy on `port` in front of `backend`."""
    return (f"upstream backend {{ server 127.0.0.1:{backend}; keepalive 128; }}\n"
            f"server {{ listen 127.0.0.1:{port};\n"
            "  location / { proxy_pass http://backend; proxy_http_version 1.1;\n"
            '    proxy_set_header Connection ""; proxy_buffering off; } }\n')


def gateway_config(path, port, threads, backend, token_mode):
    """Writes a kvgate gateway config in front of `backend`; returns its path."""
    # A context long enough for the 64 KB prompt (SmolLM2's own is 8k tokens).
    tokenizer = (f"tokenizers:\n  - {{model: bench, path: {MODEL_FILE}, block_size: 16, "
                 "context_length: 131072}\n" if token_mode else "")
    with open(path, "w") as f:
        f.write(f'listen: "127.0.0.1:{port}"\nthreads: {threads}\nreplicas:\n'
                f'  - url: "http://127.0.0.1:{backend}"\n    models: [bench]\n{tokenizer}')
    return path


def start_proxies(backend, tmp, threads, tag, before):
    """Each proxy in front of `backend`: name → Server. `before`: (label, binary) of an earlier
    kvgate build to run beside this one, or None."""
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    ports = {n: free_port() for n in ("nginx", "text", "token", "sglang", "vllm", "text-before",
                                      "token-before")}
    conf = nginx_conf(tmp, f"proxy-{tag}", nginx_proxy(ports["nginx"], backend), threads)
    configs = {mode: gateway_config(os.path.join(tmp, f"kvgate-{mode}-{tag}.yaml"), ports[mode],
                                    threads, backend, mode.startswith("token"))
               for mode in ("text", "token", "text-before", "token-before")}
    router = ["--host", "127.0.0.1", "--worker-urls", f"http://127.0.0.1:{backend}"]
    gateway = lambda mode, binary=KVGATE: [binary, "gateway", "--config", configs[mode]]  # noqa: E731
    commands = [
        ("nginx proxy", "nginx", [nginx, "-c", conf]),
        ("kvgate (text mode)", "text", gateway("text")),
        ("kvgate (token mode)", "token", gateway("token")),
    ]
    if before:
        label, binary = before
        commands += [(f"kvgate {label} (text mode)", "text-before", gateway("text-before", binary)),
                     (f"kvgate {label} (token mode)", "token-before", gateway("token-before", binary))]
    commands += [
        ("SGLang router 0.3.2 cache_aware", "sglang",
         [os.path.join(PEERS, "bin", "python"), "-m", "sglang_router.launch_router", "--port",
          str(ports["sglang"]), "--policy", "cache_aware", "--prometheus-host", "127.0.0.1",
          "--prometheus-port", str(free_port())] + router),
        ("vLLM router 0.1.17 consistent_hash", "vllm",
         [os.path.join(PEERS, "bin", "vllm-router"), "--port", str(ports["vllm"]), "--policy",
          "consistent_hash", "--prometheus-host", "127.0.0.1", "--prometheus-port",
          str(free_port())] + router),
    ]
    os.environ.setdefault("KVGATE_LOG", "warn")
    return {name: Server(f"{key}-{tag}", cmd, ports[key], tmp) for name, key, cmd in commands}


def save(out, name, table, data):
    """Writes OUT/NAME.md (the table printed) and OUT/NAME.json (every round's figures)."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(data, f, indent=1)


def added_ratio(shape_medians, proxy, peer, key):
    """What `proxy` adds over direct calls against what `peer` adds; "n/a" where the peer's
    figure is within a microsecond of direct (noise, as a p99 under direct's can be)."""
    direct = shape_medians["direct"][key]
    ours, theirs = shape_medians[proxy][key] - direct, shape_medians[peer][key] - direct
    return f"{max(ours, 1.0) / theirs:.2f}" if theirs >= 1.0 else "n/a"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--threads", type=int, default=1, help="worker threads of every proxy")
    ap.add_argument("--chunk-requests", type=int, default=40)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--before", metavar="LABEL=BINARY",
                    help="also run an earlier kvgate build, e.g. ac1f4d69=/tmp/kvgate-ac1f4d69")
    args = ap.parse_args()
    shapes = args.shapes.split(",")
    for s in shapes:
        if s not in SHAPES:
            raise SystemExit(f"unknown shape {s}; known: {', '.join(SHAPES)}")
    if not os.path.exists(MODEL_FILE):
        raise SystemExit(f"{MODEL_FILE} is missing: run scripts/fetch-model")
    tmp = prepare("proxy-bench", args.out)
    servers = []
    try:
        servers.append(fixed_backend(tmp, "backend-fixed", args.threads))
        fixed_port, stream_port = servers[0].port, free_port()
        servers.append(Server("backend-stream", [KVGATE, "fault-worker", "--port", str(stream_port),
                                                 "--model", "bench", "--stamp-chunks"],
                              stream_port, tmp))
        proxies = {}
        for tag, port in (("fixed", fixed_port), ("stream", stream_port)):
            before = tuple(args.before.split("=", 1)) if args.before else None
            proxies[tag] = start_proxies(port, tmp, args.threads, tag, before)
            servers += proxies[tag].values()
        names = ["direct"] + list(proxies["fixed"])
        runs = {s: {n: [] for n in names} for s in shapes}
        chunks = {n: [] for n in names}
        for _ in range(args.rounds):
            for shape in shapes:
                tag = "stream" if shape.startswith("stream") else "fixed"
                script = wrk_script(shape, tmp)
                targets = [("direct", fixed_port if tag == "fixed" else stream_port, None)]
                targets += [(n, s.port, s.proc.pid) for n, s in proxies[tag].items()]
                for name, port, pid in targets:
                    url = f"http://127.0.0.1:{port}/v1/chat/completions"
                    one = wrk(url, script, 1, 1, args.seconds, pid)
                    many = wrk(url, script, 2, 64, args.seconds)
                    runs[shape][name].append({**one, "rps": many["rps"]})
                if tag == "stream":
                    set_pace(stream_port, 1)
                    for name, port, _ in targets:
                        chunks[name] += chunk_delays(port, shape, args.chunk_requests)
                    set_pace(stream_port, 0)
        report(args, shapes, names, runs, chunks)
    finally:
        for s in reversed(servers):
            s.stop()


def labels(args):
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                if l.startswith("model name")), platform.processor())
    flags = open("/proc/cpuinfo").read()
    isa = "AVX-512" if " avx512f" in flags else ("AVX2" if " avx2" in flags else "no AVX2")
    version = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True).stdout.strip()
    return (f"{cpu} ({isa}), {os.cpu_count()} cores shared by wrk, proxies and backends; kvgate "
            f"{version} (release, jemalloc, threads: {args.threads}); nginx worker_processes "
            f"{args.threads}; wrk -t1 -c1 (latency, CPU, wake-ups) and -t2 -c64 (throughput), "
            f"{args.seconds} s x {args.rounds} rounds, medians; chunk delay over "
            f"{args.chunk_requests} streams x {STREAM_CHUNKS} chunks paced 1 ms apart")


def report(args, shapes, names, runs, chunks):
    med = {s: {n: {k: statistics.median(r[k] for r in runs[s][n]) for k in runs[s][n][0]}
               for n in names} for s in shapes}
    lines = [f"Labels: {labels(args)}.", ""]
    lines.append("| shape | proxy | req/s (64 conns) | p50 µs | p99 µs | added p50 µs | "
                 "added p99 µs | CPU µs/req | wake-ups/req |")
    lines.append("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    goals = []
    for s in shapes:
        d = med[s]["direct"]
        for n in names:
            m = med[s][n]
            cpu = f"{m['cpu_us']:.0f}" if "cpu_us" in m else ""
            wake = f"{m['wakeups']:.2f}" if "wakeups" in m else ""
            lines.append(f"| {s} | {n} | {m['rps']:.0f} | {m['p50']:.0f} | {m['p99']:.0f} | "
                         f"{m['p50'] - d['p50']:.0f} | {m['p99'] - d['p99']:.0f} | {cpu} | {wake} |")
        ng, sg = "nginx proxy", "SGLang router 0.3.2 cache_aware"
        for n in ("kvgate (text mode)", "kvgate (token mode)"):
            goals.append(f"| {s} | {n} | {added_ratio(med[s], n, ng, 'p50')} | "
                         f"{added_ratio(med[s], n, sg, 'p50')} | "
                         f"{added_ratio(med[s], n, ng, 'p99')} | "
                         f"{med[s][n]['rps'] / med[s][ng]['rps']:.2f} |")
    lines += ["", "| shape | kvgate | added p50 / nginx (≤ 2) | added p50 / SGLang (≤ 0.3) | "
              "added p99 / nginx (≤ 2) | req/s / nginx (≥ 0.8) |", "|---|---|---:|---:|---:|---:|"]
    lines += goals
    if chunks["direct"]:
        base = statistics.median(chunks["direct"])
        lines += ["", "| proxy | chunk delay p50 µs | p99 µs | added p50 µs (≤ 20 for kvgate) |",
                  "|---|---:|---:|---:|"]
        for n in names:
            c = sorted(chunks[n])
            lines.append(f"| {n} | {statistics.median(c):.0f} | {c[int(len(c) * 0.99)]:.0f} | "
                         f"{statistics.median(c) - base:.0f} |")
    text = "\n".join(lines)
    print(text)
    save(args.out, f"proxy-threads{args.threads}", text,
         {"labels": labels(args), "runs": runs, "chunks": chunks})


if __name__ == "__main__":
    main()
