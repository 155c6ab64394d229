"""Weight-only int8 (``--quantization int8``) and the matmul form of compiled decode steps.

An ``Int8Weight`` holds int8 values [N, K] and symmetric scales: one per output channel
([N], what ``quantize_int8`` makes from a float weight) or one per group of ``group``
input channels ([N, K / group]: GGUF Q8_0's blocks of 32 with their float16 scales, loaded as
they are by ``loader.iter_gguf_q8_0``). The value of an element is ``q * scale``.
Activations stay in the model dtype (W8A16 / W8A32).

``reduction_linear`` is how every matmul is written inside a compiled decode step
(``runner/decode_graph.py``): a sum over K for each (output, row) with the weight row
outermost, so Inductor turns it into one loop that streams each weight row once for all
rows of a small batch, with int8 -> float and the scales folded into the loads. On a
2-core AMD EPYC Zen 4 it read 28-30 GB/s (float32, M = 1..2) where oneDNN's prepacked
GEMV read 20-28 and MKL's 11; int8 at M = 1 read 27 GB/s of int8 (1.6 ms for what
takes 6 ms in float32). It is compute-bound sooner than a GEMM (bf16 from M = 4).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Int8Weight:
    qweight: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # float32 [N] (per channel) or [N, K / group] (per group)

    @property
    def group(self) -> int | None:
        return None if self.scales.dim() == 1 else self.qweight.shape[1] // self.scales.shape[1]

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() + self.scales.numel() * self.scales.element_size()

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """[N, K] in ``dtype`` (lazy under compile: folded into the consumer's loads)."""
        if self.group is None:
            values = self.qweight.float() * self.scales[:, None]
        else:
            n, k = self.qweight.shape
            values = (self.qweight.view(n, -1, self.group).float() * self.scales[:, :, None]).view(n, k)
        return values.to(dtype)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Eager: torch's int8 GEMV kernel where it is fast (bf16 activations, per-channel
        scales), else dequantize and multiply (prefill-sized steps amortise it)."""
        if x.dtype == torch.bfloat16 and self.group is None and x.device.type == "cpu" and x.dim() == 2:
            out = torch._weight_int8pack_mm(x, self.qweight, self.scales.to(x.dtype))
            return out if bias is None else out + bias
        return F.linear(x, self.dequantize(x.dtype), bias)


def int8_buffers(module: torch.nn.Module, prefix: str = "") -> Int8Weight | None:
    """The int8 weights ``set_int8_buffers`` gave ``module`` under ``prefix``; None if none."""
    qweight = module._buffers.get(f"{prefix}qweight")
    return None if qweight is None else Int8Weight(qweight, module._buffers[f"{prefix}scales"])


def set_int8_buffers(module: torch.nn.Module, weight: Int8Weight, prefix: str = "") -> None:
    """Keep int8 weights as non-persistent buffers of ``module``: they move with it, and a
    compiled step guards them like parameters (a dataclass attribute cost ~1 ms of Dynamo
    guard lookups per SmolLM2 step)."""
    module.register_buffer(f"{prefix}qweight", weight.qweight, persistent=False)
    module.register_buffer(f"{prefix}scales", weight.scales, persistent=False)


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """Per-output-channel symmetric int8: scale = max |w| / 127 over the row."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return Int8Weight(q, scales)


def stored(x: torch.Tensor) -> torch.Tensor:
    """Inside a compiled step, make Inductor store ``x`` (a norm's output, say) once
    instead of inlining its computation into every output row's loop of the matmul that
    reads it; eager, ``x`` itself. (A low ``realize_cpu_opcount_threshold`` did this for
    every node, the weight-side dequantisation included, which then went through memory
    as a float copy.)"""
    from torch._inductor import inductor_prims

    return inductor_prims.force_stride_order(x, x.stride()) if torch.compiler.is_compiling() else x


def reduction_linear(x: torch.Tensor, weight: torch.Tensor | Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias) as a reduction per (output, row): see the module doc."""
    x = stored(x)
    if isinstance(weight, Int8Weight):
        if weight.group is None:
            out = (weight.qweight[:, None, :] * x[None, :, :]).sum(-1) * weight.scales[:, None].to(x.dtype)
        else:  # [N, 1, groups, group] x [1, M, groups, group]: the scale is one load per group
            n, k = weight.qweight.shape
            groups, m = k // weight.group, x.shape[0]
            out = (weight.qweight.view(n, 1, groups, weight.group) * weight.scales.view(n, 1, groups, 1).to(x.dtype)
                   * x.view(1, m, groups, weight.group)).sum((-2, -1))
    else:
        out = (weight[:, None, :] * x[None, :, :]).sum(-1)
    out = out.t()
    return out if bias is None else out + bias
