"""The official OpenAI Python client, through the gateway, against a real CPU worker: a greedy
chat answer must equal llama.cpp's for the same rendered prompt, streamed or not, and logprobs
must be consistent with greedy choice.

Usage: openai_greedy.py BASE_URL MODEL QUESTION EXPECTED_ANSWER
Exits non-zero with a message on the first mismatch.
"""
import math
import sys

from openai import OpenAI


def main() -> None:
    base_url, model, question, expected = sys.argv[1:5]
    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": question}]

    chat = client.chat.completions.create(
        model=model, messages=messages, temperature=0, max_tokens=32, logprobs=True, top_logprobs=3
    )
    answer = chat.choices[0].message.content
    assert answer == expected, f"answer {answer!r} != llama.cpp's {expected!r}"
    entries = chat.choices[0].logprobs.content
    assert len(entries) == chat.usage.completion_tokens, (len(entries), chat.usage)
    for e in entries:
        assert len(e.top_logprobs) == 3, e
        # Greedy: the chosen token is the most likely one (ties aside) and a probability.
        assert e.logprob <= 0 and math.isclose(e.top_logprobs[0].logprob, e.logprob, abs_tol=1e-6), e
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob, e
    # The tokens' bytes spell the answer (a token may hold part of a character).
    spelled = b"".join(bytes(e.bytes) for e in entries).decode("utf-8", errors="replace")
    assert spelled == answer, (spelled, answer)

    stream = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=32, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == expected, f"streamed {streamed!r} != {expected!r}"
    print(f"openai client: greedy answer equals llama.cpp's ({len(entries)} tokens), streamed too")


if __name__ == "__main__":
    main()
