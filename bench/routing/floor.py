#!/usr/bin/env python3
"""The TTFT no router can beat on a run: each request alone on an idle sim worker, with every
prefix that any earlier request of the run carried already cached (the ideal single-replica
reuse). What is left is the request's own prefill, timed with the sim backend's roofline
(`Profile::step_seconds` in worker/src/backend/profile.rs, mirrored here) under the
scheduler's default budget of 2,048 tokens a step, times the run's --time-scale.

Usage: bench/routing/floor.py RESULTS_DIR [--profile P] [--time-scale 4]
RESULTS_DIR holds a Mooncake run's requests.csv (prompt lengths as the worker counted them);
the trace and its block size are the experiment's. Prints the floor's P50/P90/P99 over the
measured (non-warm-up) requests, the same percentiles of each request's TTFT minus its floor
(what routing added: queueing and lost reuse), and checks the model against the run: no
measured TTFT may lie below its request's floor.
"""
import argparse, csv, json, os, re, sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROFILE = os.path.join(ROOT, "config", "profiles", "h200-llama-3.1-8b-bf16.yaml")
STEP_TOKENS = 2048  # SchedulerConfig::default().max_num_batched_tokens
TRACE_BLOCK = 512   # tokens per Mooncake hash id


def load_profile(path):
    """The numeric leaves of the profile YAML, by key (they are unique in a profile)."""
    values = {}
    for line in open(path):
        m = re.match(r"\s+(\w+):\s*([0-9.eE+-]+)\s*(#.*)?$", line)
        if m:
            values[m.group(1)] = float(m.group(2))
    m = re.search(r"^step_overhead_us:\s*([0-9.]+)", open(path).read(), re.M)
    values["step_overhead_us"] = float(m.group(1))
    return values


def step_seconds(p, start, length):
    """One step computing `length` tokens after `start` (profile.rs `step_seconds`)."""
    bytes_ = p["weight_bytes"] + (start + length) * p["kv_bytes_per_token"]
    flops = 2.0 * p["parameters"] * length
    flops += 4.0 * p["layers"] * p["hidden_size"] * length * (start + (length + 1) / 2)
    bandwidth = p["memory_bandwidth_gb_s"] * 1e9 * p["bandwidth"]
    compute = p["peak_tflops"] * 1e12 * p["compute"]
    return max(bytes_ / bandwidth, flops / compute) + p["step_overhead_us"] * 1e-6


def prefill_seconds(p, cached, total):
    seconds, done = 0.0, cached
    while done < total:
        n = min(STEP_TOKENS, total - done)
        seconds += step_seconds(p, done, n)
        done += n
    return seconds


def prompt_tokens(row):
    """The prompt's length as the worker counted it (a refusal states it in its message)."""
    if row["prompt_tokens"]:
        return int(row["prompt_tokens"])
    m = re.search(r"prompt has (\d+) tokens", row["error"])
    return int(m.group(1)) if m else None


def in_trace_order(entries, rows, block_tokens):
    """The run's rows, one per trace entry. The bench numbers requests as it sends them, so
    requests arriving within a millisecond may swap: each entry takes the nearest unclaimed
    row (by sending order) whose prompt length matches its own plus the chat template's."""
    scaled = [min(-(-e["input_length"] * block_tokens // TRACE_BLOCK),
                  len(e["hash_ids"]) * block_tokens) for e in entries]
    # The template's length: the commonest difference over the first rows.
    diffs = [prompt_tokens(r) - n for r, n in zip(rows[:20], scaled) if prompt_tokens(r)]
    template = max(set(diffs), key=diffs.count)
    claimed, ordered = set(), []
    for i, length in enumerate(scaled):
        near = sorted(range(max(0, i - 8), min(len(rows), i + 9)), key=lambda j: abs(j - i))
        match = next((j for j in near if j not in claimed
                      and prompt_tokens(rows[j]) == length + template), None)
        if match is None:
            sys.exit(f"trace entry {i} ({length} tokens) has no row near it: not this trace?")
        claimed.add(match)
        ordered.append((entries[i], length, rows[match]))
    return ordered


def floors(p, trace, rows, block_tokens, time_scale):
    """(measured TTFT, floor) in seconds for each measured request of the run."""
    entries = [json.loads(line) for line in open(trace)][: len(rows)]
    seen, out = set(), []
    for entry, scaled, row in in_trace_order(entries, rows, block_tokens):
        if row["status"] != "200":
            continue  # refused (longer than the context): it cached nothing
        prompt = int(row["prompt_tokens"])
        held = 0
        for h in entry["hash_ids"]:
            if h not in seen:
                break
            held += 1
        # The chat template's tokens precede the trace's blocks; count them as cached too.
        cached = min(prompt - 1, prompt - scaled + held * block_tokens)
        seen.update(entry["hash_ids"])
        if row["warmup"] != "true":
            floor = prefill_seconds(p, cached, prompt) * time_scale
            out.append((float(row["ttft_s"]), floor))
    return out


def percentile(values, q):
    v = sorted(values)
    return v[min(len(v) - 1, int(q / 100 * len(v)))]


def summarize(results, time_scale, block_tokens=64, trace=None, profile=PROFILE):
    """Seconds: the floor's percentiles, those of TTFT minus floor, and the smallest such gap."""
    trace = trace or os.path.join(ROOT, "..", "shared", "traces", "synthetic_trace.jsonl")
    rows = sorted(csv.DictReader(open(os.path.join(results, "requests.csv"))),
                  key=lambda r: int(r["index"]))
    pairs = floors(load_profile(profile), trace, rows, block_tokens, time_scale)
    pct = lambda v: {f"p{q}": percentile(v, q) for q in (50, 90, 99)}
    excess = [t - f for t, f in pairs]
    return {"requests": len(pairs), "floor": pct([f for _, f in pairs]),
            "over_floor": pct(excess), "least_over_floor": min(excess)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results")
    ap.add_argument("--profile", default=PROFILE)
    ap.add_argument("--time-scale", type=float, default=4.0)
    ap.add_argument("--block-tokens", type=int, default=64)
    ap.add_argument("--trace", default=None)
    args = ap.parse_args()
    s = summarize(args.results, args.time_scale, args.block_tokens, args.trace, args.profile)
    ms = lambda v: " ".join(f"{q} {v[q] * 1000:.0f}" for q in ("p50", "p90", "p99"))
    print(f"floor over {s['requests']} requests: TTFT {ms(s['floor'])} ms")
    print(f"TTFT over its floor (queueing and lost reuse): {ms(s['over_floor'])} ms")
    print(f"smallest measured TTFT minus its floor: {s['least_over_floor'] * 1000:+.1f} ms")
    if s["least_over_floor"] < -0.005:
        sys.exit("a request beat its floor: the model does not match the sim worker")


if __name__ == "__main__":
    main()
