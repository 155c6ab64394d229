"""``torch.ops.hyprefix.decode_attention``: one query token per row over its paged K/V,
read in place through the block table, with its log-sum-exp (``decode_attention.cpp`` has
the loop and the split over rows and runs of blocks).

It serves every decode step that reads a block table: the compiled batch-1 step (as one
extern call a layer), eager decode without a plan that shares a prefix across rows
(``DecodeCascade.shares_prefix``), and such a plan's per-row tails; int8 float32 Llama-family
steps run the same code inside ``DecodeModel`` (``decode_layers.cpp``, through
``decode_attention.h``). ``available(dtype)`` says whether it runs here:
``hardware.DeviceCaps.paged_decode`` (an x86 CPU whose ATen ISA is AVX2 or AVX-512) and the
build for that ISA worked. Otherwise the blocks are gathered
into a padded batch for torch's SDPA (``models/attention.py``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from hyprefix.hardware import device_caps
from hyprefix.kernels.build import load_vector_op

SOURCE = Path(__file__).with_suffix(".cpp")

_runs: dict[torch.dtype, bool] = {}


def available(dtype: torch.dtype) -> bool:
    """Whether ``decode_attention`` runs ``dtype`` on CPU in this process (builds and loads it
    the first time). A lookup in a plain dict after that, so a compiled graph reads it as a
    constant; ``ModelRunner`` asks before any step is compiled."""
    if dtype not in _runs:
        _runs[dtype] = device_caps("cpu").paged_decode(dtype) and load_vector_op(
            SOURCE, "hyprefix::decode_attention", _fake, "decode attention gathers its blocks for torch's SDPA")
    return _runs[dtype]


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, window: int | None = None,
                     first_pos: torch.Tensor | None = None,
                     run_blocks: int = 0, v_dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H, D] over caches [blocks, block_size, KVH, D] (contiguous, q's dtype) through
    ``tables`` [B, W] -> (out [B, H, v_dim or D] in q's dtype, float32 log-sum-exp [B, H]).

    The caches may instead both hold 8-bit packed rows (``--kv-cache-dtype``,
    ``models/kv_quant.py``): [blocks, block_size, KVH, D + 2] of ``torch.int8`` or
    ``torch.float8_e4m3fn``, each row D codes and a float16 scale. The kernel reads them in place,
    each row dequantized as it is loaded (code * scale, exact in float32), so the result is that
    of the float32 cache ``kv_quant.dequantize_rows`` makes; q stays float32 / bfloat16 / float16.
    A latent cache may hold packed rows too (its chunks of rows dequantized as they are read).

    Row b's table slot j holds position ``j + first_pos[b]`` (first_pos None: 0) and is
    visible when that is before ``context_lens[b]`` and, with a ``window``, no more than
    ``window`` positions back. A row that sees no key gets zeros and a log-sum-exp of -inf.
    ``run_blocks`` > 0 (the batch-invariant mode): a row's keys are split into runs of that
    many blocks at fixed positions and merged in order, so its result is the same bits whatever
    the other rows and the threads; 0: runs sized by the threads and the batch.
    ``v_dim``: each head's output is the first ``v_dim`` values of its attention (None: all D).
    A latent cache (MLA: ``v_cache`` is ``k_cache``, one KV head) takes its own path, which reads
    each key row once for every query head and weighs only those first ``v_dim`` values of
    each row (``latent_attention.h``).
    Call only where ``available(q.dtype)``."""
    return torch.ops.hyprefix.decode_attention(q, k_cache, v_cache, tables, context_lens, first_pos, scale,
                                               window or 0, run_blocks, v_dim or 0)


def _fake(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
          context_lens: torch.Tensor, first_pos: torch.Tensor | None, scale: float,
          window: int, run_blocks: int = 0, v_dim: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The outputs' shapes and dtypes, for torch.compile."""
    return (q.new_empty((q.shape[0], q.shape[1], v_dim or q.shape[2])),
            q.new_empty(q.shape[:2], dtype=torch.float32))
