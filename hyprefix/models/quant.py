"""int8 weights (``--quantization int8``) and the matmul form of compiled decode steps.

An ``Int8Weight`` holds int8 values [N, K] and symmetric scales: one per output channel
([N], what ``quantize_int8`` makes from a float weight) or one per group of ``group``
input channels ([N, K / group]: GGUF Q8_0's blocks of 32 with their float16 scales, loaded as
they are by ``gguf_weights.GGUFWeights.quantized``). The value of an element is ``q * scale``.

Where K is a multiple of 32 the activations are quantized too, to int8 per group of 32
(scale max|x| / 127, round to nearest even): llama.cpp's Q8_0 dot product. On an x86 CPU
with AVX512-VNNI or AVX2 the weights are kept as ``Int8Tiles``, the layout of
``kernels/int8_linear.cpp``, which multiplies them in int8 for every batch size (decode and
prefill); elsewhere (``quantize_activations`` then a float matmul) the same numbers are
computed in the model dtype. A K that is not a multiple of 32 keeps float activations.

``reduction_linear`` is how every other matmul is written inside a compiled decode step
(``runner/decode_graph.py``): a sum over K for each (output, row) with the weight row
outermost, so Inductor turns it into one loop that streams each weight row once for all
rows of a small batch, with int8 -> float and the scales folded into the loads. It is
compute-bound sooner than a GEMM, and int8 weights read faster through the tiled kernel, which
takes them wherever it builds (the AVX2 build included). bf16 weights go to ``Bf16Tiles``
where ``kernels/bf16_linear.cpp`` runs (native bf16 with AVX512-BF16), which reads them
faster than this loop (``docs/perf-log.md``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hyprefix.kernels import bf16_linear as bf16_kernel
from hyprefix.kernels import int8_linear as kernel
from hyprefix.kernels import quant_linear as quant_kernel

GROUP = 32  # activation quantization group


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

    @property
    def quantizes_activations(self) -> bool:
        """Whether its inputs are quantized per 32 (K a multiple of 32); else they stay float."""
        return self.qweight.shape[1] % GROUP == 0

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Eager, any batch size: dequantize and multiply (prefill-sized steps amortise it)."""
        if self.quantizes_activations:
            x = quantize_activations(x)
        return F.linear(x, self.dequantize(x.dtype), bias)

    def plain(self) -> Int8Weight:
        return self


@dataclass
class Int8Tiles:
    """int8 weights in ``kernels/int8_linear.cpp``'s 16-row tiles (``kernel.pack``), used
    where that kernel runs: the same values as the ``Int8Weight`` they came from."""

    tiles: torch.Tensor  # uint8 [N/16, K/4, 16, 4]
    scales: torch.Tensor  # float32 [N/16 * 16] or [N/16, K/32, 16]
    rows: int  # N

    @classmethod
    def pack(cls, weight: Int8Weight) -> Int8Tiles:
        kernel.available()  # loads the build, which registers the op ``matmul`` calls
        return cls(*kernel.pack(weight.qweight, weight.scales), weight.qweight.shape[0])

    def plain(self) -> Int8Weight:
        return Int8Weight(*kernel.unpack(self.tiles, self.scales, self.rows))

    @property
    def group(self) -> int | None:
        return None if self.scales.dim() == 1 else GROUP

    @property
    def nbytes(self) -> int:
        return self.tiles.numel() + self.scales.numel() * self.scales.element_size()

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self.plain().dequantize(dtype)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The int8 kernel (eager or inside a compiled step); the plain path for what it does
        not take (another device or dtype)."""
        if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
            return self.plain().matmul(x, bias)
        out = kernel.int8_linear(x, self.tiles, self.scales, self.rows)
        return out if bias is None else out + bias


@dataclass
class QuantTiles:
    """A matrix in ``kernels/quant_tiles.h``'s low-bit tiles: a list of parts (a GGUF's Q4_0 /
    Q4_1 / Q5_K blocks as Q4 tiles, Q4_K as Q4K, Q6_K as Q6, MXFP4 as MX4, Q8_0 as int8 tiles), each a run of
    whole 16-row tiles but the last, so a fused matrix keeps each shard's own format. Multiplied
    by ``quant_linear`` (activations quantized per 32, as the int8 kernel); lookups and the
    portable path dequantize rows (``quant_rows``)."""

    tensors: list[torch.Tensor]  # [data, scales, extra] per part (``part_format`` tells their format)
    rows: int
    cols: int

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids``, dequantized to float32 [*ids.shape, cols] (an embedding's lookups)."""
        return quant_kernel.rows(self.tensors, self.rows, self.cols, ids)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self.lookup(torch.arange(self.rows)).to(dtype)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The kernel for CPU float32 / bfloat16 inputs; otherwise the dequantized matrix (as
        ``quantize_activations`` rounds the inputs, so both paths compute the same numbers)."""
        if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
            return F.linear(quantize_activations(x), self.dequantize(x.dtype).to(x.device), bias)
        out = quant_kernel.quant_linear(x, self.tensors, self.rows)
        return out if bias is None else out + bias


def int8_part(weight: Int8Weight) -> list[torch.Tensor]:
    """A GGUF Q8_0 matrix (scales per 32) as a ``QuantTiles`` part: the int8 kernel's tiles."""
    tiles, scales = kernel.pack(weight.qweight, weight.scales)
    return [tiles, scales, torch.empty(0, dtype=torch.uint8)]


def part_format(part: list[torch.Tensor]) -> str:
    """A part's format ([data, scales, extra]): the data's third dimension (16 int8, 4 Q4, Q4K or
    MX4, 6 Q6), Q4 told apart by its float16 scales, Q4K and MX4 by their uint8 codes' count (32
    or 16 a group)."""
    data, scales = part[0], part[1]
    if data.shape[2] != 4:
        return {16: "int8", 6: "q6"}[data.shape[2]]
    return "q4" if scales.dtype != torch.uint8 else "mxfp4" if scales.shape[2] == 16 else "q4k"


def join_parts(parts: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Consecutive parts of one format joined into one (every part but the last holds whole
    tiles): fewer, longer runs for the kernel."""
    joined: list[list[torch.Tensor]] = []
    for part in parts:
        if joined and part_format(joined[-1]) == part_format(part):
            joined[-1] = [torch.cat([a, b]) if a.numel() else a for a, b in zip(joined[-1], part, strict=True)]
        else:
            joined.append(list(part))
    return [t for part in joined for t in part]


def quantize_q4(weight: torch.Tensor) -> list[torch.Tensor]:
    """A float matrix [n, K] (K a multiple of 32) as a Q4 part: per group of 32 an unsigned
    4-bit code over the group's range, float16 scale and offset (value = s * q + o)."""
    w = weight.detach().float().unflatten(1, (-1, GROUP))
    low, high = w.amin(-1), w.amax(-1)
    scale = ((high - low) / 15).half().float()
    offset = low.half().float()
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round((w - offset[..., None]) * inverse[..., None]).clamp(0, 15).to(torch.uint8).flatten(1)
    return list(quant_kernel.pack(q, scale.half(), offset.half()))


def quantize_q4k(weight: torch.Tensor) -> list[torch.Tensor]:
    """A float matrix [n, K] (K a multiple of 256) as a Q4K part, GGUF's Q4_K with 8-bit codes
    for its two levels: per group of 32 a 4-bit code over [min(low, 0), high], the group's step
    and -min as 8-bit codes of a float16 d and dmin per 256 (value d * sc * q - dmin * m)."""
    w = weight.detach().float().unflatten(1, (-1, GROUP))  # [n, K/32, 32]
    low = w.amin(-1).clamp(max=0)
    step, lift = (w.amax(-1) - low) / 15, -low  # [n, K/32]
    per_super = 256 // GROUP
    d = (step.unflatten(1, (-1, per_super)).amax(-1) / 255).half().float()  # [n, K/256]
    dmin = (lift.unflatten(1, (-1, per_super)).amax(-1) / 255).half().float()
    d_groups, dmin_groups = d.repeat_interleave(per_super, dim=1), dmin.repeat_interleave(per_super, dim=1)

    def codes(values: torch.Tensor, unit: torch.Tensor) -> torch.Tensor:
        # rounded up, so the group's range stays within the codes' (0..15 steps from the min)
        return torch.where(unit > 0, torch.ceil(values / unit.clamp(min=1e-30)), 0).clamp(0, 255)

    sc, m = codes(step, d_groups), codes(lift, dmin_groups)
    group_step, group_min = sc * d_groups, m * dmin_groups
    inverse = torch.where(group_step > 0, 1.0 / group_step, torch.zeros_like(group_step))
    q = torch.round((w + group_min[..., None]) * inverse[..., None]).clamp(0, 15).to(torch.uint8).flatten(1)
    return list(quant_kernel.pack(q, torch.stack([sc, m], -1).to(torch.uint8), torch.stack([d, dmin], -1).half()))


def quantize_low_bit(weight: torch.Tensor) -> list[torch.Tensor]:
    """``--quantization int4``'s part for a float matrix: Q4K where K fills groups of 256, else Q4."""
    return quantize_q4k(weight) if weight.shape[1] % 256 == 0 else quantize_q4(weight)


def quantize_mxfp4(weight: torch.Tensor) -> list[torch.Tensor]:
    """A float matrix [n, K] (K a multiple of 32) as an MX4 part, as ggml quantizes MXFP4: per
    group of 32 the E8M0 scale 2^(floor(log2(max |w|)) - 2) (the largest E2M1 value is 6, about
    2^2.6) and each value's nearest E2M1 code."""
    w = weight.detach().float().unflatten(1, (-1, GROUP))
    amax = w.abs().amax(-1)
    e = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp(min=1e-38))) - 2 + 127, torch.zeros_like(amax))
    e = e.clamp(0, 254)
    unit = torch.where(e > 0, torch.exp2(e - 128), torch.zeros_like(e))  # the doubled values' unit
    values = torch.tensor(quant_kernel.MXFP4_VALUES, dtype=torch.float32)
    scaled = torch.where(unit[..., None] > 0, w / unit[..., None].clamp(min=1e-38), torch.zeros_like(w))
    q = (scaled[..., None] - values).abs().argmin(-1).to(torch.uint8).flatten(1)
    return list(quant_kernel.pack(q, e.to(torch.uint8), torch.empty(0, dtype=torch.float16)))


def quantize_q6(weight: torch.Tensor) -> list[torch.Tensor]:
    """A float matrix [n, K] (K a multiple of 256) as a Q6 part, as GGUF's Q6_K lays it out: per
    run of 16 a 6-bit code q - 32 times an int8 scale, times a float16 d per 256."""
    w = weight.detach().float().unflatten(1, (-1, 16))
    run_scale = w.abs().amax(-1) / 31  # [n, K/16]: q - 32 in [-32, 31]
    d = (run_scale.unflatten(1, (-1, 16)).amax(-1) / 127).half().float()  # [n, K/256]
    d_runs = d.repeat_interleave(16, dim=1)
    sc = torch.where(d_runs > 0, torch.round(run_scale / d_runs.clamp(min=1e-30)), torch.zeros_like(d_runs))
    sc = sc.clamp(-127, 127)
    step = sc * d_runs
    inverse = torch.where(step > 0, 1.0 / step, torch.zeros_like(step))
    q = (torch.round(w * inverse[..., None]).clamp(-32, 31) + 32).to(torch.uint8).flatten(1)
    return list(quant_kernel.pack(q, sc.to(torch.int8), d.half()))


def requantize_like(weight: torch.Tensor, tiles: QuantTiles) -> list[torch.Tensor]:
    """``weight`` (a new value of the matrix, [rows, cols]) quantized into ``tiles``' parts, each
    in its own format and rows (a weight update of a GGUF model keeps its layout)."""
    out: list[list[torch.Tensor]] = []
    start = 0
    for i in range(0, len(tiles.tensors), 3):
        data = tiles.tensors[i]
        rows = min(data.shape[0] * 16, tiles.rows - start)
        piece = weight[start:start + rows]
        start += rows
        quantize = {"int8": lambda w: int8_part(quantize_int8(w, GROUP)), "q4": quantize_q4, "q4k": quantize_q4k,
                    "q6": quantize_q6, "mxfp4": quantize_mxfp4}[part_format(tiles.tensors[i:i + 3])]
        out.append(quantize(piece))
    return [t for part in out for t in part]


def tiles_fit(weight: Int8Weight) -> bool:
    """Whether ``weight`` goes to the int8 kernel's tiles (CPU, K a multiple of 32, the kernel built)."""
    return weight.qweight.device.type == "cpu" and weight.quantizes_activations and kernel.available()


def uses_tile_kernels(model: torch.nn.Module) -> bool:
    """Whether any of ``model``'s weights are ``Int8Tiles`` or ``Bf16Tiles`` (multiplied by a kernel)."""
    return any(name.endswith("tiles") for name, _ in model.named_buffers())  # their buffers' names


@dataclass
class Bf16Tiles:
    """A bfloat16 weight in ``kernels/bf16_linear.cpp``'s 16-row tiles: the copy a compiled
    decode step multiplies where that kernel runs, in place of the plain weight
    (``weights.MatrixForms``); eager steps keep oneDNN's prepacked copy."""

    tiles: torch.Tensor  # bfloat16 [N/16, K/2, 16, 2]
    rows: int  # N

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The kernel (bf16 CPU inputs and bias, where it runs); otherwise the plain weight's matmul."""
        if x.device.type == "cpu" and x.dtype == torch.bfloat16 and (bias is None or bias.dtype == x.dtype) \
                and bf16_kernel.available():
            return bf16_kernel.bf16_linear(x, self.tiles, self.rows, bias)
        weight = bf16_kernel.unpack(self.tiles, self.rows).to(x.dtype)
        return F.linear(x, weight, None if bias is None else bias.to(x.dtype))


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to int8 per group of 32 along its last dim (the int8 kernel's
    quantization), dequantized back to x's dtype."""
    groups = x.float().unflatten(-1, (-1, GROUP))
    scale = groups.abs().amax(-1, keepdim=True) / 127.0
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    return (torch.round(groups * inverse) * scale).flatten(-2).to(x.dtype)


def quantize_int8(weight: torch.Tensor, group: int | None = None) -> Int8Weight:
    """Symmetric int8, scale = max |w| / 127 over each output row, or with ``group`` over
    each run of ``group`` input channels of a row (GGUF Q8_0's layout, for 32)."""
    w = weight.detach().float()
    runs = w.unflatten(1, (-1, group or w.shape[1]))  # per channel: one run a row
    scales = runs.abs().amax(dim=2).clamp(min=1e-12) / 127.0
    q = torch.round(runs / scales[:, :, None]).clamp(-127, 127).to(torch.int8).flatten(1)
    return Int8Weight(q, scales if group else scales[:, 0].contiguous())


def stored(x: torch.Tensor) -> torch.Tensor:
    """Inside a compiled step, make Inductor store ``x`` (a norm's output, say) once
    instead of inlining its computation into every output row's loop of the matmul that
    reads it; eager, ``x`` itself. (A low ``realize_cpu_opcount_threshold`` did this for
    every node, the weight-side dequantisation included, which then went through memory
    as a float copy.)"""
    from torch._inductor import inductor_prims

    return inductor_prims.force_stride_order(x, x.stride()) if torch.compiler.is_compiling() else x


def reduction_linear(x: torch.Tensor, weight: torch.Tensor | Int8Weight | Int8Tiles | Bf16Tiles | QuantTiles,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias) as a reduction per (output, row): see the module doc.
    Tiled int8, low-bit and bf16 weights call their kernels instead (extern calls inside the graph)."""
    if isinstance(weight, Int8Tiles | Bf16Tiles | QuantTiles):
        return weight.matmul(x, bias)
    x = stored(x)
    if isinstance(weight, Int8Weight):
        if weight.quantizes_activations:
            x = stored(quantize_activations(x))
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
