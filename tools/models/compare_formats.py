"""Which format of a GGUF model answers as the reference does: greedy chat answers of the
engine in each weight format against transformers' on the same file (dequantized to float32),
and a batch-1 decode rate per format (one run: a rough guide, not a benchmark).

    .venv/bin/python tools/models/compare_formats.py [--model smollm2-135m-instruct]

The default model's format (``hyprefix.catalog``) was chosen with it (docs/models.md)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from hyprefix import LLM, SamplingParams
from hyprefix.catalog import CATALOG, DEFAULT_MODEL, fetch_model

QUESTIONS = ["What is the capital of France?", "What is the capital of Germany?", "Write a haiku about the sea.",
             "What is 2 + 2?", "Name three colors."]
FORMATS = {"file's blocks (GGUF default)": {"quantization": None}, "none, float32": {"quantization": "none",
           "dtype": "float32"}, "none, bfloat16": {"quantization": "none", "dtype": "bfloat16"},
           "int8": {"quantization": "int8"}}


def reference_answers(path: Path, max_tokens: int) -> list[str]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    answers = []
    for question in QUESTIONS:
        ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False)
        answers.append(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip())
    return answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(CATALOG), help="a catalog model")
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens per answer")
    args = parser.parse_args()
    path = fetch_model(CATALOG[args.model])
    reference = reference_answers(path, args.max_tokens)
    print(f"transformers, float32: {reference[0]!r}")
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    for name, kwargs in FORMATS.items():
        llm = LLM(str(path), log_stats_interval=0, **kwargs)
        outs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], greedy, use_tqdm=False)
        answers = [o.outputs[0].text.strip() for o in outs]
        t0 = time.perf_counter()
        llm.generate(["Tell me a story"], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
                     use_tqdm=False)
        rate = 64 / (time.perf_counter() - t0)
        same = sum(a == b for a, b in zip(answers, reference, strict=True))
        print(f"{name}: {same}/{len(QUESTIONS)} answers equal transformers'; {rate:.0f} tok/s at batch 1; "
              f"{answers[0]!r}")
        del llm


if __name__ == "__main__":
    main()
