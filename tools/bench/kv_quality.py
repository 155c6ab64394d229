"""Quality of the 8-bit K/V cache (``--kv-cache-dtype``) against the model-dtype cache, on real files:

    .venv/bin/python tools/bench/kv_quality.py --model FILE [--model FILE ...] [--dtype auto]
        [--quantization none] [--formats int8,fp8_e4m3] [--max-text-tokens 1200] [--max-tokens 64]
        [--control-noise 1e-4] [--out JSON] [--markdown]

For every file, ``LLM(file, kv_cache_dtype="auto")`` is the reference and each 8-bit format is loaded
in turn (one engine at a time, the same ``--dtype`` and ``--quantization``) and compared with it, with
``gguf_quality``'s measures:

- next-token distributions over long texts: ``gguf_quality.TEXTS`` joined into one document in
  order and one in reverse order, each cut to ``--max-text-tokens`` (past 1,000 tokens), prefilled
  whole, the LM head applied at EVERY position; per position KL(ref || 8-bit) in nats over the full
  vocabulary. Every attention of the 8-bit engine reads the K/V as stored (quantized), the
  prefill's own keys included, so later positions see ~1,000 quantized keys. Reported: mean, 99th
  percentile and max KL, top-1 agreement, the mean NLL of the texts' next tokens;
- greedy decoding of ``gguf_quality.PROMPTS`` for ``--max-tokens`` tokens: the % of completions
  identical to the reference's and the mean common prefix.

The control row (``--control-noise``, 0: none) is the reference engine with every K and V row
multiplied by (1 + eps * N(0, 1)) before it is written and attended: what a perturbation far
below any 8-bit format's error costs. Where the weights run as the file's low-bit tiles, their
activations are rounded to int8 per 32 values in every matmul, and that rounding turns any
perturbation, however small, into a floor of KL (SmolLM2 Q8_0: ~3e-3 at eps 1e-4, the same as
the 8-bit caches); ``--quantization none`` (the default: every matrix dequantized to float) has no
such floor, so the rows measure the cache alone.

Sliding-window layers keep their K/V in the main pool here (``disable_hybrid_swa_memory``: the same
attention, and ``position_logits`` reads one pool). No timings are taken.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for path in (ROOT, ROOT / "tools" / "bench"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import gguf_quality as gq  # noqa: E402  (tools/bench on the path above)
import torch  # noqa: E402


@contextlib.contextmanager
def kv_noise(eps: float):
    """K and V rows times (1 + eps * N(0, 1)) before every write and attention (the control row)."""
    from hyprefix.models import attention, llama

    original = attention.paged_attention
    gen = torch.Generator().manual_seed(0)

    def noisy(q, k, v, *args, **kwargs):
        k, v = (t * (1 + eps * torch.randn(t.shape, generator=gen, dtype=t.dtype)) for t in (k, v))
        return original(q, k, v, *args, **kwargs)

    llama.paged_attention = noisy
    try:
        yield
    finally:
        llama.paged_attention = original


def evaluate(model: str, formats: list[str], dtype: str, quantization: str | None, max_text_tokens: int,
             max_tokens: int, tokenizer: str | None, control_noise: float) -> dict:
    """One file's report: a row per 8-bit format against the model-dtype cache (the reference's own
    second pass first: KL 0 and full agreement check the measurement)."""
    from hyprefix import LLM

    documents = [" ".join(gq.TEXTS), " ".join(reversed(gq.TEXTS))]
    text_ids, prompt_ids, chat = gq.encode_inputs(model, documents, gq.PROMPTS, max_text_tokens, tokenizer)
    kwargs = dict(dtype=dtype, quantization=quantization, disable_hybrid_swa_memory=True, log_stats_interval=0,
                  max_model_len=4096)
    if tokenizer:
        kwargs["tokenizer"] = tokenizer

    def run(llm) -> tuple[list, list[list[int]]]:
        return [gq.position_logits(llm, t) for t in text_ids], gq.greedy_tokens(llm, prompt_ids, max_tokens)

    ref = LLM(model, kv_cache_dtype="auto", **kwargs)
    ref_logits, ref_tokens = run(ref)
    report = {"model": model, "dtype": str(ref.engine.runner.model.dtype).removeprefix("torch."),
              "quantization": quantization,
              "texts_tokens": [len(t) for t in text_ids], "chat_prompts": chat, "prompts": len(prompt_ids),
              "max_tokens": max_tokens, "rows": []}
    ref.reset_prefix_cache()
    rows = [("auto (second pass)", ref)]
    if control_noise:
        rows.append((f"auto, K/V x (1 + {control_noise:g} N(0,1)) (control)", ref))
    for fmt in formats:
        rows.append((fmt, None))
    for name, llm in rows:
        llm = llm or LLM(model, kv_cache_dtype=name, **kwargs)
        llm.reset_prefix_cache()
        with kv_noise(control_noise) if name.endswith("(control)") else contextlib.nullcontext():
            logits, tokens = run(llm)
        stats = llm.get_stats()
        row = {"kv_cache_dtype": name, "kv_tokens_per_gib": stats["kv_tokens_per_gib"],
               **gq.distribution_agreement(ref_logits, logits, text_ids), **gq.greedy_agreement(ref_tokens, tokens)}
        report["rows"].append(row)
        print(f"{Path(model).name}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                                  for k, v in row.items()), file=sys.stderr, flush=True)
        del llm, logits
        gc.collect()
    return report


def markdown(report: dict) -> str:
    weights = "float" if report["quantization"] == "none" else "the file's own"
    lines = [f"**{Path(report['model']).name}** ({report['dtype']}, {weights} weights; texts of "
             f"{report['texts_tokens']} tokens, "
             f"{report['prompts']} greedy prompts of {report['max_tokens']} tokens)", "",
             "| K/V cache | tokens / GiB | mean KL | p99 KL | max KL | top-1 agree | greedy identical | "
             "common prefix |", "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['kv_cache_dtype']} | {r['kv_tokens_per_gib']:.0f} | {r['mean_kl']:.2e} | "
                     f"{r['p99_kl']:.2e} | {r['max_kl']:.2e} | {r['top1_pct']:.1f} % | "
                     f"{r['identical_pct']:.0f} % | {r['mean_common_prefix']:.1f} / {r['mean_ref_tokens']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", required=True, help="a GGUF file or checkpoint (repeatable)")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer for files without one")
    parser.add_argument("--dtype", default="auto", help="the engines' --dtype (the reference cache's dtype)")
    parser.add_argument("--quantization", default="none",
                        help="the engines' --quantization (default none: weights dequantized to float; 'file': "
                             "the file's own formats)")
    parser.add_argument("--formats", default="int8,fp8_e4m3", help="comma-separated 8-bit --kv-cache-dtype values")
    parser.add_argument("--control-noise", type=float, default=1e-4,
                        help="relative noise on K/V of the control row (0: no control row)")
    parser.add_argument("--max-text-tokens", type=int, default=1200, help="tokens of each long text")
    parser.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt")
    parser.add_argument("--out", default=None, help="write the JSON report here")
    parser.add_argument("--markdown", action="store_true", help="print markdown tables")
    args = parser.parse_args()
    quantization = None if args.quantization == "file" else args.quantization
    reports = [evaluate(m, args.formats.split(","), args.dtype, quantization, args.max_text_tokens, args.max_tokens,
                        args.tokenizer, args.control_noise) for m in args.model]
    result = {"date": datetime.date.today().isoformat(), "reports": reports}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    print("\n\n".join(markdown(r) for r in reports) if args.markdown else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
