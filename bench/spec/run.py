#!/usr/bin/env python3
"""Speculative decoding on the CPU backend against llama.cpp's llama-server, same GGUF, same
threads, same prompts, run back to back: kvgate without speculation and with each drafter,
llama-server without and with each of its speculative modes. Two workloads: input-grounded
(repeat, rewrite or reformat a given text, answer from a passage) and open chat; one stream
at a time and 16 at once. Per cell: decode tokens/s (completion tokens after the first over
the time from the first to the last streamed chunk, summed over requests), draft acceptance,
and how many greedy outputs differ from the same engine's without speculation. At 16 streams the
figure is every completion token over the load's wall time (prefill included). Every server
gets the same prompt token ids (each chat rendered once by kvgate's `/tokenize`), so that
outputs compare token for token across engines. Each round runs every config once, starting
one config further along than the round before (a VM's speed drifts within minutes: a fixed
order gave the config after llama-server's draft mode a steady 15 % edge); the table at the
end gives each cell's median over rounds and each kvgate config's median ratio to plain
kvgate in the same round. At one stream, each kvgate drafter's figure also stands beside the
gain its steps allow: the decode tokens over the steps' cost in one-token steps, by the step
costs the worker measured at start (its log) at the mean verified length of its drafts; the
ratio of the two says how much of that gain the engine turned into tokens.

Usage: bench/spec/run.py [--threads 1] [--max-tokens 128] [--rounds 2] [--out DIR]
Needs `cargo build --release --bin kvgate` (done here) and `bench/peers/install-llama`.
Every server started here runs in a session of its own and is stopped by its PID, also when
the script is interrupted or fails.
"""
import argparse, json, os, re, statistics, sys, time, urllib.request
import concurrent.futures as cf

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from servers import Server, free_port, post, prepare, stream  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
MODEL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
PEERS = os.environ.get("KVGATE_PEERS", "/tmp/kvgate-peers")
LLAMA = os.path.join(PEERS, "llama.cpp", "build", "bin", "llama-server")

ITEMS = ["apple", "banana", "cherry", "date", "elderberry", "fig", "grape", "honeydew",
         "kiwi", "lemon", "mango", "nectarine"]
GROUNDED = [
    "Repeat the following list exactly, one item per line:\n" + "\n".join(ITEMS),
    "Rename the variable `items` to `values` and return the whole function:\n```python\n"
    "def total(items):\n    result = 0\n    for item in items:\n        if item > 0:\n"
    "            result += item\n    return result\n```",
    "Reformat this JSON with two-space indentation:\n"
    '{"name": "kvgate", "version": "0.1", "parts": ["gateway", "agent", "worker"], '
    '"limits": {"streams": 16, "tokens": 2048}}',
    "Copy this sentence and then translate nothing: The quick brown fox jumps over the lazy "
    "dog while the cat sleeps on the warm windowsill.",
    "Here is a passage: The river Elbe rises in the Krkonose mountains and flows through "
    "Dresden and Hamburg into the North Sea. Quote the sentence of the passage that names "
    "the cities.",
    "Rewrite this list in reverse order:\n" + "\n".join(f"{i}. {w}" for i, w in enumerate(ITEMS[:8], 1)),
    "Write the same Python function again, adding type hints:\n```python\n"
    "def greet(name, times):\n    for _ in range(times):\n        print('hello', name)\n```",
    "Extract every fruit from this text as a comma-separated list: I bought apples, a banana, "
    "two cherries and some grapes, then a lemon and a mango.",
]
OPEN = [
    "What is the capital of France?", "Tell me a short story about a dragon.",
    "Why is the sky blue?", "Give me three tips for learning to cook.",
    "What are the planets of the solar system?", "Explain what a computer is to a child.",
    "Write a haiku about autumn.", "How do airplanes stay in the air?",
]


def step_costs(log_path):
    """The step costs a kvgate worker logged at start, {tokens: cost of a one-token step}."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", open(log_path).read())
    found = re.search(r"step_costs=\[([^\]]*)\]", text)
    if not found:
        return None
    return {int(n): float(c) for n, c in re.findall(r"\((\d+), ([0-9.e+-]+)\)", found.group(1))}


def cost_at(costs, tokens):
    """A step's cost at a fractional token count, linear between the measured sizes."""
    sizes = sorted(costs)
    below = max((n for n in sizes if n <= tokens), default=sizes[0])
    above = min((n for n in sizes if n >= tokens), default=sizes[-1])
    if above == below:
        return costs[below] * tokens / below
    share = (tokens - below) / (above - below)
    return costs[below] + share * (costs[above] - costs[below])


def allowed_gain(costs, decode_tokens, drafts, drafted, kept):
    """Decode tokens over the cost of the steps that made them (one stream): each draft's step
    at the mean verified length, every other step one token."""
    if not costs or not drafts:
        return None
    plain_steps = decode_tokens - drafts - kept
    cost = plain_steps + drafts * cost_at(costs, 1 + drafted / drafts)
    return decode_tokens / cost


def render(port, prompt):
    """A user message as the chat template renders and tokenizes it (kvgate's /tokenize)."""
    with post(port, "/tokenize", {"messages": [{"role": "user", "content": prompt}]}, 30) as r:
        return json.load(r)["tokens"]


def complete(port, prompt_ids, max_tokens):
    """One greedy streamed completion of token ids: (text, completion tokens, decode seconds,
    timings)."""
    body = {"model": "smollm2", "prompt": prompt_ids, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    text, tokens, first, last, timings = [], None, None, None, {}
    for data in stream(port, "/v1/completions", body):
        if data.get("usage"):
            tokens = data["usage"]["completion_tokens"]
        timings = data.get("timings", timings)
        for c in data.get("choices", []):
            piece = c.get("text")
            if piece:
                now = time.perf_counter()
                first = first or now
                last = now
                text.append(piece)
    return "".join(text), tokens or 0, (last - first) if first else 0.0, timings


def load(port, prompts, streams, max_tokens):
    with cf.ThreadPoolExecutor(streams) as pool:
        return list(pool.map(lambda p: complete(port, p, max_tokens), prompts))


def metric(port, name):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith(name):
            key, _, value = line.rpartition(" ")
            values[key] = float(value)
    return values


def configs(threads):
    kv = lambda *extra: ["target/release/kvgate", "worker", "--backend", "cpu", "--threads",
                         str(threads), "--max-num-seqs", "16", "--kv-cache-mib", "256",
                         "--max-model-len", "4096", "--served-model-name", "smollm2", *extra]
    llama = lambda *extra: [LLAMA, "-m", MODEL, "-t", str(threads), "-np", "16", "-c", "32768",
                            "--metrics", *extra]
    return [
        ("kvgate", "kvgate", kv()),
        ("kvgate ngram", "kvgate", kv("--spec-method", "ngram")),
        ("kvgate suffix", "kvgate", kv("--spec-method", "suffix")),
        # The model as its own draft model: as costly as itself, so kvgate's plan never runs it.
        ("kvgate draft (itself)", "kvgate", kv("--spec-method", "draft", "--spec-draft-model", MODEL)),
        ("llama-server", "llama", llama()),
        ("llama-server ngram-simple", "llama", llama("--spec-type", "ngram-simple")),
        ("llama-server ngram-mod", "llama", llama("--spec-type", "ngram-mod")),
        ("llama-server ngram-map-k", "llama", llama("--spec-type", "ngram-map-k")),
        ("llama-server draft (itself)", "llama", llama("-md", MODEL, "--spec-type", "draft-simple")),
    ]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", help="comma-separated config names to run (plain kvgate always)")
    ap.add_argument("--cells", default="grounded:1,grounded:16,open chat:1,open chat:16",
                    help="comma-separated WORKLOAD:STREAMS cells to measure")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "spec", "results"))
    args = ap.parse_args()
    logs = prepare("spec", args.out)
    rows, reference, rendered = [], {}, {}
    chosen = configs(args.threads)
    if args.only:
        keep = set(args.only.split(","))
        chosen = [c for c in chosen if c[0] in keep or c[0] == "kvgate"]
    cells = [(w, int(n)) for w, n in (c.rsplit(":", 1) for c in args.cells.split(","))]
    for rnd in range(args.rounds):
        turn = rnd % len(chosen)
        for name, kind, cmd in chosen[turn:] + chosen[:turn]:
            port = free_port()
            server = Server(name.replace(" ", "-").replace("(", "").replace(")", ""),
                            [*cmd, "--port", str(port)], port, logs)
            try:
                if not rendered:
                    # Rendered by the first kvgate server to start (every round has one).
                    rendered = {w: [render(port, p) for p in ps]
                                for w, ps in (("grounded", GROUNDED), ("open chat", OPEN))}
                for workload, streams in cells:
                    if workload not in rendered:
                        raise SystemExit(f"{name} started before any kvgate server rendered the prompts")
                    prompts = rendered[workload]
                    batch = prompts * (2 if streams == 16 else 1)
                    before = metric(port, "kvgate_worker_spec_decode") if kind == "kvgate" else {}
                    started = time.perf_counter()
                    results = load(port, batch, streams, args.max_tokens)
                    wall = time.perf_counter() - started
                    after = metric(port, "kvgate_worker_spec_decode") if kind == "kvgate" else {}
                    tokens = sum(max(n - 1, 0) for _, n, _, _ in results)
                    seconds = sum(s for _, _, s, _ in results)
                    # One stream: its decode rate; 16: all tokens over the load's wall time.
                    rate = tokens / seconds if streams == 1 else sum(n for _, n, _, _ in results) / wall
                    gain = None
                    if kind == "kvgate":
                        d = lambda k: after.get(k, 0) - before.get(k, 0)
                        drafted = d("kvgate_worker_spec_decode_draft_tokens_total")
                        kept = d("kvgate_worker_spec_decode_accepted_tokens_total")
                        drafts = d("kvgate_worker_spec_decode_drafts_total")
                        per_pos = [d(f'kvgate_worker_spec_decode_accepted_tokens_per_pos_total{{position="{i}"}}')
                                   for i in range(8)]
                        if streams == 1:
                            gain = allowed_gain(step_costs(server.log.name), tokens, drafts,
                                                drafted, kept)
                    else:
                        drafted = sum(t.get("draft_n", 0) for *_, t in results)
                        kept = sum(t.get("draft_n_accepted", 0) for *_, t in results)
                        drafts, per_pos = None, None
                    texts = [t for t, *_ in results]
                    # Against the same engine's plain output (the first config of each
                    # kind); llama-server's plain output also against kvgate's (llama.cpp
                    # built for AVX-512 rounds otherwise than kvgate, which reproduces its
                    # AVX2 build).
                    reference.setdefault((kind, workload, streams), texts)
                    differ = sum(a != b for a, b in zip(texts, reference[(kind, workload, streams)]))
                    kvgate_texts = reference.get(("kvgate", workload, streams), texts)
                    differ_from_kvgate = sum(a != b for a, b in zip(texts, kvgate_texts))
                    row = dict(round=rnd + 1, config=name, workload=workload, streams=streams,
                               tok_s=round(rate, 1), drafted=drafted, accepted=kept,
                               acceptance=round(kept / drafted, 3) if drafted else None,
                               mean_accepted_length=round(1 + kept / drafts, 2) if drafts else None,
                               accepted_per_pos=per_pos, outputs_differ=differ,
                               outputs_differ_from_kvgate=differ_from_kvgate,
                               outputs=len(texts),
                               allowed_gain=round(gain, 3) if gain else None)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            finally:
                server.stop()
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(table(rows, cells))
    print()
    print(ratios(rows, cells))


def ratios(rows, cells):
    """Markdown: each kvgate config's tok/s over plain kvgate's and over llama-server's fastest
    config's, each in the same round (median, then every round's)."""
    def rate(rnd, config, w, n):
        got = [r["tok_s"] for r in rows
               if (r["round"], r["config"], r["workload"], r["streams"]) == (rnd, config, w, n)]
        return got[0] if got else None

    def cell(config, w, n, over):
        rs = []
        for rnd in sorted({r["round"] for r in rows}):
            a, b = rate(rnd, config, w, n), over(rnd, w, n)
            if a and b:
                rs.append(a / b)
        if not rs:
            return ""
        return f"{statistics.median(rs):.2f} [{' '.join(f'{x:.2f}' for x in rs)}]"

    def allowed(rnd, config, w, n):
        # The plain rate times the gain the config's steps allow: its rate over that is the
        # share of the allowed gain it got.
        got = [r.get("allowed_gain") for r in rows
               if (r["round"], r["config"], r["workload"], r["streams"]) == (rnd, config, w, n)]
        plain = rate(rnd, "kvgate", w, n)
        return got[0] * plain if got and got[0] and plain else None

    def llama_best(rnd, w, n):
        got = [r["tok_s"] for r in rows if r["round"] == rnd and r["config"].startswith("llama")
               and (r["workload"], r["streams"]) == (w, n)]
        return max(got) if got else None

    header = " | ".join(f"{w}, {n} stream{'s' * (n > 1)}" for w, n in cells)
    lines = [f"| ratio, same round | {header} |", "|---|" + "---:|" * len(cells)]
    kvgate = [c for c in dict.fromkeys(r["config"] for r in rows) if not c.startswith("llama")]
    for config in kvgate[1:]:
        lines.append(f"| {config} / kvgate | "
                     + " | ".join(cell(config, w, n, lambda rnd, w, n: rate(rnd, "kvgate", w, n))
                                  for w, n in cells) + " |")
    for config in kvgate[1:]:
        if any(r["config"] == config and r.get("allowed_gain") for r in rows):
            lines.append(f"| {config}: gain / gain its steps allow | "
                         + " | ".join(cell(config, w, n, lambda rnd, w, n: allowed(rnd, config, w, n))
                                      for w, n in cells) + " |")
    for config in kvgate:
        lines.append(f"| {config} / llama-server's fastest | "
                     + " | ".join(cell(config, w, n, llama_best) for w, n in cells) + " |")
    return "\n".join(lines)


def table(rows, cells):
    """Markdown: each config's median tok/s per cell over the rounds (min-max beside it), with
    acceptance and outputs unlike the same engine's without speculation."""
    lines = ["| config | " + " | ".join(f"{w}, {n} stream{'s' * (n > 1)}" for w, n in cells) + " |",
             "|---|" + "---:|" * len(cells)]
    for config in dict.fromkeys(r["config"] for r in rows):
        out = []
        for w, n in cells:
            got = [r for r in rows if r["config"] == config and r["workload"] == w and r["streams"] == n]
            rates = sorted(r["tok_s"] for r in got)
            if not rates:
                out.append("")
                continue
            text = f"{statistics.median(rates):.1f} ({rates[0]:.1f}-{rates[-1]:.1f})"
            drafted = sum(r["drafted"] or 0 for r in got)
            if drafted:
                text += f", acc {sum(r['accepted'] for r in got) / drafted:.2f}"
            differ = sum(r["outputs_differ"] for r in got)
            if differ:
                text += f", {differ}/{sum(r['outputs'] for r in got)} differ"
            if config == "llama-server":
                unlike = sum(r["outputs_differ_from_kvgate"] for r in got)
                text += f", {unlike}/{sum(r['outputs'] for r in got)} unlike kvgate's"
            out.append(text)
        lines.append(f"| {config} | " + " | ".join(out) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
