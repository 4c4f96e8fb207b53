"""Records llama.cpp's token ids for varied strings, as golden data for the tokenizer test.

Oracle: llama-cpp-python 0.3.36 (bench/peers/install-llama installs it, ~15 minutes).
Usage: python record_tokens.py MODEL.gguf > tokens.json
Each case is tokenized twice: with special-token parsing (ChatML markers become their ids)
and without (they are plain text), never adding BOS.
"""
import json
import sys

from llama_cpp import Llama

CASES = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces and   runs of    spaces  ",
    "tabs\tand\nnewlines\r\n\n\nand more",
    "Numbers: 0 7 42 123 2024 3.14159 -17 1e10 1,000,000",
    "Dates 2026-11-29 and times 13:45:07Z",
    "https://example.com/path?query=1&other=two#frag",
    '{"key": "value", "list": [1, 2, 3], "nested": {"a": null}}',
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "fn main() { println!(\"{}\", 1 + 2); }",
    "Café naïve résumé façade Ångström",
    "Привет, мир! Как дела?",
    "日本語のテキストと中文文本",
    "emoji 😀🎉👍🏽 and flags 🇫🇷",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|> special in the middle <|im_end|> of text",
    "mixed CASE WoRdS and under_scores and camelCase",
    "punctuation!!! ??? ... --- *** ### @@@",
    "a" * 300,
    "1234567890" * 10,
    "I'm can't won't they're we've",
    "\u00a0non-breaking\u2009thin\u200bzero-width",
    "control \x06! chars \x13 here",
    "",
]


def main() -> None:
    llm = Llama(model_path=sys.argv[1], vocab_only=True, verbose=False)
    out = []
    for text in CASES:
        data = text.encode("utf-8")
        out.append({
            "text": text,
            "special": llm.tokenize(data, add_bos=False, special=True),
            "plain": llm.tokenize(data, add_bos=False, special=False),
        })
    lines = ",\n".join(json.dumps(c, ensure_ascii=False) for c in out)
    print('{"oracle": "llama-cpp-python 0.3.36", "cases": [\n' + lines + "\n]}")


if __name__ == "__main__":
    main()
