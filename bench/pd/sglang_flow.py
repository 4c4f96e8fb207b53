"""SGLang's prefill/decode hand-over, kvgate against SGLang's own router (0.3.2,
`--pd-disaggregation`): both in front of the same two recording workers (`kvgate
fault-worker`, which keeps the bodies it receives), the same requests through each, and what
the prefill and the decode worker received compared field by field. The room's value differs
by design (fresh per request); everything else should not.

    bench/peers/install     # once: SGLang's router in /tmp/kvgate-peers
    python3 bench/pd/sglang_flow.py [--out bench/pd/results]
"""
import argparse, json, os, sys, urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from servers import ROOT, Server, free_port, post, prepare  # noqa: E402

PEERS = os.environ.get("KVGATE_PEERS", "/tmp/kvgate-peers")
KVGATE = os.path.join(ROOT, "target", "release", "kvgate")
BOOTSTRAP_PORT = 9100
REQUESTS = [
    ("/v1/chat/completions", {"model": "test-model", "max_tokens": 8, "temperature": 0,
                              "messages": [{"role": "user", "content": "hello there"}]}),
    ("/v1/chat/completions", {"model": "test-model", "max_tokens": 4, "stream": True,
                              "messages": [{"role": "user", "content": "stream this"}]}),
    ("/v1/completions", {"model": "test-model", "prompt": "once upon a time", "max_tokens": 5}),
]


def received(worker):
    with urllib.request.urlopen(f"http://127.0.0.1:{worker.port}/received", timeout=5) as r:
        return json.load(r)


def drive(router_port, workers):
    """Sends every request through the router; returns what each worker got for it."""
    seen = []
    for path, body in REQUESTS:
        before = [len(received(w)) for w in workers]
        with post(router_port, path, body, timeout=60) as r:
            r.read()
        got = []
        for w, n in zip(workers, before):
            for _ in range(100):
                now = received(w)
                if len(now) > n:
                    break
                __import__("time").sleep(0.05)
            got.append(now[n] if len(now) > n else None)
        seen.append({"path": path, "sent": body, "prefill": got[0], "decode": got[1]})
    return seen


HAND_OVER = ("bootstrap_host", "bootstrap_port")
# SGLang's router parses a request and writes it out again under OpenAI's newer name.
RENAMED = {"max_tokens": "max_completion_tokens"}


def check(run):
    """What a router's hand-over looks like: the bootstrap fields, whether both workers got the
    same body, whether the client's fields arrived with their values, and what was added."""
    out = []
    for r in run:
        p, d, sent = r["prefill"] or {}, r["decode"] or {}, r["sent"]
        carried = all(d.get(k, d.get(RENAMED.get(k))) == v for k, v in sent.items())
        room = d.get("bootstrap_room")
        out.append({
            "path": r["path"], "stream": bool(sent.get("stream")),
            "same_body_to_both": p == d,
            "hand_over": {k: d.get(k) for k in HAND_OVER},
            "room_is_63_bit": isinstance(room, int) and 0 <= room < 2**63,
            "client_fields_carried": carried,
            "added": sorted(set(d) - set(sent) - set(HAND_OVER) - {"bootstrap_room"}
                            - {RENAMED.get(k) for k in sent}),
        })
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "pd", "results"))
    args = ap.parse_args()
    logs = prepare("pd-sglang", args.out)
    servers = []
    try:
        prefill, decode = free_port(), free_port()
        for name, port in (("prefill", prefill), ("decode", decode)):
            servers.append(Server(name, [KVGATE, "fault-worker", "--port", str(port), "--id", name],
                                  port, logs))
        workers = servers[:2]
        sglang = free_port()
        servers.append(Server("sglang-router", [
            os.path.join(PEERS, "bin", "python"), "-m", "sglang_router.launch_router",
            "--host", "127.0.0.1", "--port", str(sglang), "--pd-disaggregation",
            "--prefill", f"http://127.0.0.1:{prefill}", str(BOOTSTRAP_PORT),
            "--decode", f"http://127.0.0.1:{decode}", "--policy", "round_robin"], sglang, logs))
        theirs = drive(sglang, workers)
        servers.pop().stop()
        gateway, admin = free_port(), free_port()
        config = os.path.join(logs, "gateway.yaml")
        with open(config, "w") as f:
            f.write(f"""listen: "127.0.0.1:{gateway}"
admin_listen: "127.0.0.1:{admin}"
replicas:
  - url: "http://127.0.0.1:{prefill}"
    labels: {{prefill: "yes", bootstrap_port: "{BOOTSTRAP_PORT}"}}
  - url: "http://127.0.0.1:{decode}"
    labels: {{decode: "yes"}}
disaggregation:
  pools:
    - flow: sglang
      prefill: {{prefill: "yes"}}
      decode: {{decode: "yes"}}
""")
        servers.append(Server("kvgate", [KVGATE, "gateway", "--config", config], gateway, logs))
        ours = drive(gateway, workers)
    finally:
        for s in servers:
            s.stop()
    checked = {"kvgate": check(ours), "sglang_router": check(theirs)}
    with open(os.path.join(args.out, "sglang_flow.json"), "w") as f:
        json.dump({"received": {"kvgate": ours, "sglang_router": theirs}, "checked": checked}, f,
                  indent=1)
    for a, b in zip(checked["kvgate"], checked["sglang_router"]):
        print(f"{a['path']} stream={a['stream']}")
        for key in a:
            if key not in ("path", "stream"):
                print(f"  {key:24} kvgate {json.dumps(a[key])}  sglang {json.dumps(b[key])}")
    rooms = [r["decode"]["bootstrap_room"] for r in ours]
    print(f"kvgate rooms fresh per request: {len(set(rooms)) == len(rooms)}")


if __name__ == "__main__":
    main()
