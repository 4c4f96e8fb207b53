#!/usr/bin/env python3
"""Aggregate output tokens/s of an OpenAI-compatible server under N concurrent streams: the
same load for kvgate's CPU worker and for llama-server, so the two can be compared side by
side. Each request has a distinct prompt (no prefix reuse), streams `--max-tokens` tokens with
`ignore_eos`, and the figure is total completion tokens over wall time.

Usage: throughput.py URL MODEL [--streams 16] [--requests 48] [--max-tokens 128]
Needs httpx (the project's .venv has it, as a dependency of openai).
"""
import argparse
import asyncio
import json
import time

import httpx


async def one(client, url, model, i, max_tokens):
    prompt = f"Request {i}: write a long story about a {['cat', 'ship', 'city', 'tree'][i % 4]} number {i * 7919}."
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0, "stream_options": {"include_usage": True}}
    tokens, events = None, 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if data.get("usage"):
                tokens = data["usage"]["completion_tokens"]
            if data.get("choices") and data["choices"][0].get("text"):
                events += 1
    return tokens if tokens is not None else events


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("model")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=128)
    a = ap.parse_args()
    queue = asyncio.Queue()
    for i in range(a.requests):
        queue.put_nowait(i)
    total = 0

    async def worker(client):
        nonlocal total
        while not queue.empty():
            i = queue.get_nowait()
            tokens = await one(client, a.url, a.model, i, a.max_tokens)
            total += tokens

    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(a.streams)))
        elapsed = time.perf_counter() - start
    print(json.dumps({"url": a.url, "streams": a.streams, "requests": a.requests, "completion_tokens": total,
                      "seconds": round(elapsed, 2), "output_tokens_per_s": round(total / elapsed, 1)}))


if __name__ == "__main__":
    asyncio.run(main())
