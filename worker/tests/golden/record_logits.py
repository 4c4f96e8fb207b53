"""Records llama.cpp's first-step logits and 32-token greedy continuations for 20 prompts on
the default GGUF, as golden data for the CPU backend test (tests/cpu_backend.rs).

Oracle: llama-cpp-python 0.3.36 over llama.cpp built for AVX2 (bench/peers/install-llama
builds it, ~15 minutes; the CPU backend reproduces that build's arithmetic).
Rerun the live comparison: bench/peers/install-llama, then this script into a scratch
directory, then point the test at it (or replace the committed files and run the test).
Usage: python record_logits.py MODEL.gguf OUT_DIR
Writes OUT_DIR/reference.json (prompts, token ids, top-1, greedy continuations) and
OUT_DIR/logits.f16 (each prompt's last-position logits, little-endian f16, in order).
"""
import json
import os
import sys

import numpy as np
from llama_cpp import Llama

CHAT = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion to a child.",
    "List three primary colors.",
    "How do I reverse a list in Python?",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 12?",
    "Give me a tip for better sleep.",
    "Who wrote Romeo and Juliet?",
    "Describe a cat in one sentence.",
]
PLAIN = [
    "The quick brown fox",
    "Once upon a time, in a small village,",
    "def fibonacci(n):\n    ",
    "1, 2, 3, 4, 5,",
    "The theory of relativity states that",
    "In 1969, the first humans",
    "Water boils at a temperature of",
    "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "The best way to learn programming is",
    "Paris is known for",
]


def main() -> None:
    model, out_dir = sys.argv[1], sys.argv[2]
    llm = Llama(model_path=model, n_ctx=512, n_batch=512, n_threads=1, logits_all=True, verbose=False)
    cases, logits = [], []
    prompts = [("chat", text) for text in CHAT] + [("plain", text) for text in PLAIN]
    for kind, text in prompts:
        rendered = text
        if kind == "chat":
            # The GGUF's own template, rendered with jinja2 as llama-cpp-python does
            # (including the default system prompt the template injects).
            from llama_cpp.llama_chat_format import Jinja2ChatFormatter
            fmt = Jinja2ChatFormatter(template=llm.metadata["tokenizer.chat_template"], eos_token="<|im_end|>", bos_token="<|im_start|>")
            rendered = fmt(messages=[{"role": "user", "content": text}]).prompt
        ids = llm.tokenize(rendered.encode("utf-8"), add_bos=False, special=True)
        llm.reset()
        llm.eval(ids)
        last = np.array(llm.scores[len(ids) - 1], dtype=np.float32)
        logits.append(last.astype(np.float16))
        llm.reset()
        greedy = []
        for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            if tok == llm.token_eos() or len(greedy) == 32:
                break
            greedy.append(tok)
        greedy_text = llm.detokenize(greedy).decode("utf-8", errors="replace")
        cases.append({"kind": kind, "text": text, "rendered": rendered, "ids": ids, "top1": int(last.argmax()), "greedy": greedy, "greedy_text": greedy_text})
    with open(os.path.join(out_dir, "reference.json"), "w") as f:
        f.write('{"oracle": "llama-cpp-python 0.3.36, llama.cpp built with GGML_NATIVE=OFF (AVX2, FMA, F16C)", "n_threads": 1, "cases": [\n')
        f.write(",\n".join(json.dumps(c, ensure_ascii=False) for c in cases))
        f.write("\n]}\n")
    np.concatenate(logits).astype("<f2").tofile(os.path.join(out_dir, "logits.f16"))


if __name__ == "__main__":
    main()
