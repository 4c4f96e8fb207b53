"""The official OpenAI Python client against the kvgate gateway.

Usage: openai_client.py BASE_URL MODEL
The test worker echoes the last user message (or the prompt), so each answer is known.
Exits non-zero with a message on the first mismatch.
"""
import sys

from openai import OpenAI


def main() -> None:
    base_url, model = sys.argv[1], sys.argv[2]
    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=20)

    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello from openai"}],
        max_tokens=16,
    )
    assert chat.choices[0].message.content == "hello from openai", chat
    assert chat.usage is not None and chat.usage.completion_tokens == 3, chat.usage

    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "streamed words arrive in order"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage = [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
    assert "".join(pieces) == "streamed words arrive in order", pieces
    assert len(pieces) == 5, pieces
    assert usage is not None and usage.prompt_tokens_details.cached_tokens == 0, usage

    completion = client.completions.create(model=model, prompt="a plain completion", max_tokens=2)
    assert completion.choices[0].text == "a plain ", completion
    assert completion.choices[0].finish_reason == "length", completion

    models = client.models.list()
    assert [m.id for m in models.data] == [model], models
    print("openai client: chat, streamed chat, completion and models ok")


if __name__ == "__main__":
    main()
