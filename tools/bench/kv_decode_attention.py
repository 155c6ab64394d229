"""Decode attention over a long context with the model-dtype and the 8-bit K/V caches, the kernel alone:

    .venv/bin/python tools/bench/kv_decode_attention.py [--context 8192] [--batch-sizes 1,16]
        [--shape smollm2|qwen3-0.6b|gemma3-270m] [--rounds 5] [--out JSON]

Per shape (query heads, KV heads, head dim, layers of the model it names) and batch size, the
caches of as many layers as fit ``--memory-gb`` (at most the model's; at least enough that a
layer's K/V is cold when read again, as in a decode step after its weights streamed through the
caches) in bfloat16, int8 and fp8_e4m3 rows (``kv_quant.quantize_rows`` of the same values), then
``hyprefix::decode_attention`` over those layers in turn, the three formats alternated within
each round; reported: the median over ``--rounds`` of the time a layer's attention takes times
the model's layers (a step's attention), the step's K/V bytes and their rate.
The machine's read rate (``bench.env.read_rate_now``) is probed before each round. q is
bfloat16 for the bfloat16 cache and float32 for the 8-bit ones (an 8-bit engine's queries are
its model dtype, rotated in float32; the kernel computes in float32 either way).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hyprefix.bench.env import read_rate_now  # noqa: E402
from hyprefix.kernels import decode_attention  # noqa: E402
from hyprefix.models import kv_quant  # noqa: E402

SHAPES = {  # query heads, KV heads, head dim, layers
    "smollm2": (9, 3, 64, 30),
    "qwen3-0.6b": (16, 8, 128, 28),
    "gemma3-270m": (4, 1, 256, 18),
}
FORMATS = ("bfloat16", "int8", "fp8_e4m3")
BLOCK = 16


def caches(shape: tuple[int, int, int, int], batch: int, context: int, layers: int) -> dict[str, list[tuple]]:
    """Per format, per layer: (k_cache, v_cache) holding ``batch`` rows of ``context`` tokens."""
    _, kv_heads, dim, _ = shape
    blocks = batch * -(-context // BLOCK)
    gen = torch.Generator().manual_seed(0)
    out: dict[str, list[tuple]] = {f: [] for f in FORMATS}
    for _ in range(layers):
        kv = [torch.randn(blocks, BLOCK, kv_heads, dim, generator=gen, dtype=torch.bfloat16) for _ in range(2)]
        out["bfloat16"].append(tuple(kv))
        for fmt in FORMATS[1:]:
            storage = kv_quant.STORAGE[fmt]
            out[fmt].append(tuple(torch.cat([kv_quant.quantize_rows(part, storage) for part in t.split(1024)])
                                  for t in kv))
    return out


def step_seconds(layers: list[tuple], q: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor) -> float:
    t0 = time.perf_counter()
    for k, v in layers:
        decode_attention.decode_attention(q, k, v, tables, lens, 0.125)
    return time.perf_counter() - t0


def measure(shape_name: str, batch: int, context: int, rounds: int, memory_gb: float) -> dict:
    heads, kv_heads, dim, layers = SHAPES[shape_name]
    layer_bytes = 2 * batch * context * kv_heads * (2 * dim + 2 * (dim + 2))  # bf16, int8 and fp8 rows
    held = max(2, min(layers, int(memory_gb * 2**30 // layer_bytes)))
    data = caches(SHAPES[shape_name], batch, context, held)
    per_row = -(-context // BLOCK)
    tables = torch.arange(batch * per_row, dtype=torch.int64).view(batch, per_row)
    lens = torch.full((batch,), context, dtype=torch.int64)
    qs = {"bfloat16": torch.randn(batch, heads, dim).bfloat16(), "int8": torch.randn(batch, heads, dim),
          "fp8_e4m3": torch.randn(batch, heads, dim)}
    for fmt in FORMATS:  # warm-up: builds, first touches
        step_seconds(data[fmt], qs[fmt], tables, lens)
    times: dict[str, list[float]] = {f: [] for f in FORMATS}
    rates = []
    for _ in range(rounds):
        rates.append(read_rate_now())
        for fmt in FORMATS:
            times[fmt].append(step_seconds(data[fmt], qs[fmt], tables, lens))
    result = {"shape": shape_name, "batch": batch, "context": context, "layers": layers, "layers_held": held,
              "read_rate_gb_s": [round(r, 1) for r in rates], "formats": {}}
    for fmt in FORMATS:
        nbytes = sum(k.nbytes + v.nbytes for k, v in data[fmt]) * layers / held
        median = statistics.median(times[fmt]) * layers / held
        result["formats"][fmt] = {"step_ms": round(median * 1e3, 3), "kv_mb": round(nbytes / 1e6, 1),
                                  "gb_s": round(nbytes / median / 1e9, 1),
                                  "rounds_ms": [round(t * 1e3 * layers / held, 2) for t in times[fmt]]}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=8192, help="tokens of K/V each row attends to")
    parser.add_argument("--batch-sizes", default="1,16", help="comma-separated decode batch sizes")
    parser.add_argument("--shape", action="append", choices=list(SHAPES), help="model shapes (default: all)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds; the median is reported")
    parser.add_argument("--memory-gb", type=float, default=6.0, help="the caches of all formats together, at most")
    parser.add_argument("--out", default=None, help="write the JSON here")
    args = parser.parse_args()
    if not decode_attention.available(torch.float32):
        raise SystemExit("the decode-attention kernel does not run here")
    results = []
    for shape in args.shape or list(SHAPES):
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            r = measure(shape, batch, args.context, args.rounds, args.memory_gb)
            results.append(r)
            line = "  ".join(f"{f} {v['step_ms']:.2f} ms ({v['kv_mb']:.0f} MB, {v['gb_s']:.1f} GB/s)"
                             for f, v in r["formats"].items())
            print(f"{shape} B={batch} ctx={args.context}: {line}  read {r['read_rate_gb_s']}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"results": results, "threads": torch.get_num_threads()}, indent=2))


if __name__ == "__main__":
    main()
