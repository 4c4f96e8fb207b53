#!/usr/bin/env python3
"""Aggregate output tokens/s of an OpenAI-compatible server under N concurrent streams: the
same load for kvgate's CPU worker and for llama-server, so the two can be compared side by
side. Each request has a distinct prompt (no prefix reuse), streams `--max-tokens` tokens with
`ignore_eos`, and the figure is total completion tokens over wall time.

Usage: throughput.py URL MODEL [--streams 16] [--requests 48] [--max-tokens 128]
Standard library only (HTTP/1.1 over asyncio streams), so any Python 3 runs it.
"""
import argparse
import asyncio
import json
import time
from urllib.parse import urlsplit


def dechunk(body: bytes) -> bytes:
    """Decodes a chunked transfer-encoded body."""
    out, i = bytearray(), 0
    while i < len(body):
        end = body.index(b"\r\n", i)
        size = int(body[i:end].split(b";")[0], 16)
        if size == 0:
            break
        out += body[end + 2:end + 2 + size]
        i = end + 2 + size + 2
    return bytes(out)


async def one(url, model, i, max_tokens):
    prompt = f"Request {i}: write a long story about a {['cat', 'ship', 'city', 'tree'][i % 4]} number {i * 7919}."
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                       "ignore_eos": True, "temperature": 0, "stream_options": {"include_usage": True}}).encode()
    u = urlsplit(url)
    reader, writer = await asyncio.open_connection(u.hostname, u.port)
    writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
    await writer.drain()
    raw = await reader.read(-1)
    writer.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    status = head.split(b" ", 2)[1]
    if status != b"200":
        raise RuntimeError(f"request {i}: HTTP {status.decode()}: {payload[:200]!r}")
    if b"transfer-encoding: chunked" in head.lower():
        payload = dechunk(payload)
    tokens, events = None, 0
    for line in payload.decode("utf-8", "replace").splitlines():
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

    async def worker():
        nonlocal total
        while not queue.empty():
            i = queue.get_nowait()
            tokens = await one(a.url, a.model, i, a.max_tokens)
            total += tokens  # after the await: `total += await ...` would read `total` first

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(a.streams)))
    elapsed = time.perf_counter() - start
    print(json.dumps({"url": a.url, "streams": a.streams, "requests": a.requests, "completion_tokens": total,
                      "seconds": round(elapsed, 2), "output_tokens_per_s": round(total / elapsed, 1)}))


if __name__ == "__main__":
    asyncio.run(main())
