"""``torch.ops.hyprefix.prefill_attention``: causal (optionally sliding-window) attention of
a prefill chunk over its keys, a flash-attention loop on oneDNN's brgemm micro-kernel
(``prefill_attention.cpp`` has the blocking and the layouts); it replaces torch's SDPA in
prefill where it runs (``docs/benchmarks.md``).

``available(dtype)`` says whether it runs here: ``hardware.DeviceCaps.flash_prefill`` (an x86
CPU with AVX2 or AVX-512; bfloat16 only where it is native), the build for this ISA worked,
and one tiny call ran (oneDNN refuses bf16 brgemm on some CPUs at run time). Otherwise
prefill attention stays on torch's SDPA (``models/attention.py``).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from hyprefix.hardware import device_caps
from hyprefix.kernels.build import load_vector_op

log = logging.getLogger("hyprefix")

SOURCE = Path(__file__).with_suffix(".cpp")

_runs: dict[torch.dtype, bool] = {}


def available(dtype: torch.dtype) -> bool:
    """Whether ``prefill_attention`` runs ``dtype`` in this process (builds, loads and tries it
    the first time)."""
    if dtype not in _runs:
        caps = device_caps("cpu")
        _runs[dtype] = caps.flash_prefill(dtype) and load_vector_op(
            SOURCE, "hyprefix::prefill_attention", _fake, "prefill attention stays on torch's SDPA") and _tries(dtype)
    return _runs[dtype]


def _tries(dtype: torch.dtype) -> bool:
    q = torch.zeros(2, 2, 32, dtype=dtype)
    try:
        torch.ops.hyprefix.prefill_attention(q, q[:, :1], q[:, :1], 1.0, 0, 0, 0)
    except RuntimeError as exc:
        log.warning("prefill attention in %s stays on torch's SDPA: the kernel refused it here (%s)",
                    str(dtype).removeprefix("torch."), str(exc).splitlines()[0])
        return False
    return True


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_pos0: int,
                      k_pos0: int, window: int | None, block_table: torch.Tensor | None = None,
                      keys: int = -1, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention of q [T, H, D] (float32 or bfloat16) over k, v [S, KVH, D] (the head dim
    contiguous; H a multiple of KVH) -> [T, H, D] in q's dtype. Query t sits at position ``q_pos0 + t``, key j at
    ``k_pos0 + j``; a key is visible when it is not after the query and, with a ``window``,
    fewer than ``window`` positions before it. With ``block_table`` (int64 [n]), k and v are
    paged caches [blocks, block_size, KVH, D] and the ``keys`` keys are what
    ``k.index_select(0, block_table).flatten(0, 1)[:keys]`` would gather, read in place. k and v
    may instead both hold 8-bit packed rows (``models/kv_quant.py``: ``torch.int8`` or
    ``torch.float8_e4m3fn``, last dim D + 2), each row dequantized as the kernel packs K and V:
    the result is bit for bit the call over ``kv_quant.dequantize_rows(rows, q.dtype)`` of the
    same keys. ``sinks`` [H]: a logit per head added to each softmax's denominator (gpt-oss). Call only where
    ``available(q.dtype)``."""
    return torch.ops.hyprefix.prefill_attention(q, k, v, scale, q_pos0, k_pos0, window or 0, block_table, keys, sinks)


def _fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_pos0: int, k_pos0: int,
          window: int, block_table: torch.Tensor | None = None, keys: int = -1,
          sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The output's shape and dtype, for torch.compile."""
    return q.new_empty(q.shape)
