"""One weight matrix in the forms the engine multiplies it in (``MatrixForms``), and the
oneDNN prepacked matmuls.

A matrix [rows, cols] starts as its owner's plain tensor (a ``Linear``'s weight, or the
embedding table a tied LM head reuses). After loading it may gain, by the loader's choice:

* **packed**: oneDNN's blocked layout (``pack_weight``; CPU, the dtypes
  ``hardware.DeviceCaps.prepack`` allows), for eager steps and batched compiled decode steps;
  a fused gate/up matrix is packed as its two halves, so the activation and the product run
  in the matmuls' epilogues (``linear_methods.packed_gate_up``);
* **int8**: ``Int8Weight`` or the int8 kernel's ``Int8Tiles`` (``quant.py``), in place of
  the float matrix for every matmul;
* **quant**: ``QuantTiles``, a GGUF's low-bit blocks (Q4 / Q6 / Q8_0 tiles, ``quant.py``), in
  place of the float matrix for every matmul (and, for an embedding table, every lookup);
* **bf16 tiles**: ``Bf16Tiles``, what a compiled decode step multiplies where the bf16 kernel
  runs, kept in place of the plain tensor beside the packed copy.

The batch-invariant mode (``use_batch_invariant``, before packing) adds no form of its own: a
bfloat16 matrix takes its bf16 tiles where ``bf16_linear`` runs (whose arithmetic per row is
fixed), any other keeps only its plain tensor, multiplied by ``kernels/invariant_linear.cpp``.

Which form a step multiplies is the forms' method (``linear_methods``), chosen as forms are
added at load; ``MatrixForms.matmul`` applies it. The int8 and bf16
tensors are non-persistent buffers of the ``MatrixForms`` module: they move with the model
(huge pages) and a compiled step reads them as lasting inputs like parameters (a dataclass
attribute would cost Dynamo guard lookups every step). oneDNN's packed copies are opaque
tensors, kept as plain attributes.
"""

from __future__ import annotations

import torch
from torch import nn

from hyprefix.hardware import device_caps
from hyprefix.kernels import bf16_linear as bf16_kernel
from hyprefix.models import linear_methods as methods
from hyprefix.models.linear_methods import EAGER_TILE_ROWS, LinearMethod
from hyprefix.models.quant import (
    Bf16Tiles,
    Int8Tiles,
    Int8Weight,
    QuantTiles,
    quantize_int8,
    requantize_like,
    tiles_fit,
)

# What a matmul of a compiled decode step reads: the int8 or low-bit weights, the bf16 tiles, or
# the plain weight.
GraphWeight = torch.Tensor | Int8Weight | Int8Tiles | Bf16Tiles | QuantTiles


def mkldnn_packing_available(weight: torch.Tensor) -> bool:
    """Whether this weight's dtype is prepacked on its device (``hardware.DeviceCaps.prepack``)."""
    return device_caps(weight.device).prepack(weight.dtype)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight in oneDNN's blocked layout, which oneDNN's prepacked matmul reads faster
    than the plain layout on CPU, at decode and prefill sizes (``docs/perf-log.md``)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


class MatrixForms(nn.Module):
    """The packed, int8 and bf16-tile forms of one [rows, cols] matrix; its plain tensor stays
    with the owner, which passes it in (it may be emptied once another form replaces it)."""

    def __init__(self, rows: int, cols: int) -> None:
        super().__init__()
        self.rows, self.cols = rows, cols
        self.packed: torch.Tensor | None = None
        self.packed_halves: tuple[torch.Tensor, torch.Tensor] | None = None
        self.method: LinearMethod = methods.PLAIN  # how ``matmul`` multiplies: set as forms are added
        self.eager_tiles = False  # eager decode-sized matmuls take the bf16 tiles (``tiles_take``)

    def attribute_tensors(self) -> list[torch.Tensor]:
        """The tensors held as plain attributes, not buffers (oneDNN's packed copies), which a
        compiled step reads beside the parameters and buffers."""
        return [t for t in (self.packed, *(self.packed_halves or ())) if t is not None]

    @property
    def int8(self) -> Int8Weight | Int8Tiles | None:
        buffers = self._buffers
        if "tiles" in buffers:
            return Int8Tiles(buffers["tiles"], buffers["scales"], self.rows)
        qweight = buffers.get("qweight")
        return None if qweight is None else Int8Weight(qweight, buffers["scales"])

    @property
    def quant(self) -> QuantTiles | None:
        """The low-bit tiles (buffers ``quant{i}_tiles``, ``_scales``, ``_extra`` per part)."""
        if "quant0_tiles" not in self._buffers:
            return None
        tensors = []
        for i in range(len(self._buffers) // 3 + 1):
            if f"quant{i}_tiles" not in self._buffers:
                break
            tensors += [self._buffers[f"quant{i}_{leaf}"] for leaf in ("tiles", "scales", "extra")]
        return QuantTiles(tensors, self.rows, self.cols)

    @property
    def quantized(self) -> Int8Weight | Int8Tiles | QuantTiles | None:
        """The int8 or low-bit form, whichever this matrix has (None: float)."""
        int8 = self.int8
        return int8 if int8 is not None else self.quant

    def use_quant(self, tensors: list[torch.Tensor]) -> None:
        """Multiply by these low-bit tiles from now on ([data, scales, extra] per part, ``QuantTiles``)."""
        for name in [n for n in self._buffers if n.startswith("quant")]:
            del self._buffers[name]
        for i in range(0, len(tensors), 3):
            for leaf, tensor in zip(("tiles", "scales", "extra"), tensors[i:i + 3], strict=True):
                self.register_buffer(f"quant{i // 3}_{leaf}", tensor, persistent=False)
        self.packed = self.packed_halves = None
        self.method = methods.QUANT

    def use_column_order(self, order: torch.Tensor) -> None:
        """The low-bit tiles hold the matrix with its columns in the order of a GGUF file whose
        converter reordered them (the matrix is the tiles' ``[:, order]``; columns cannot move
        inside a block, ``gguf_blocks``): from now on each input is gathered into the tiles' order
        first (the buffer ``column_gather``, ``order``'s inverse)."""
        self.register_buffer("column_gather", torch.argsort(order), persistent=False)

    @property
    def input_index(self) -> torch.Tensor | None:
        return self._buffers.get("column_gather")

    @property
    def bf16(self) -> Bf16Tiles | None:
        tiles = self._buffers.get("bf16_tiles")
        return None if tiles is None else Bf16Tiles(tiles, self.rows)

    @property
    def fp32(self) -> torch.Tensor | None:
        """An LM head's float32 copy (``use_fp32``; the buffer ``fp32_weight``), which
        ``CausalLM.compute_logits`` multiplies instead of every other form; None where the head
        runs in the model's dtype."""
        return self._buffers.get("fp32_weight")

    def use_fp32(self, plain: torch.Tensor) -> None:
        """Keep a float32 copy of ``plain`` (an LM head's weight, ``--lm-head-fp32``). A
        non-persistent buffer like the other forms: it moves with the model and a compiled
        decode step reads it as a lasting input, so a weight update must refresh it in place."""
        self.register_buffer("fp32_weight", plain.detach().float().contiguous(), persistent=False)

    def graph_weight(self, plain: torch.Tensor) -> GraphWeight:
        """What a compiled decode step multiplies: the int8 or low-bit weights, the bf16 tiles, or ``plain``."""
        quantized = self.quantized
        if quantized is not None:
            return quantized
        tiles = self.bf16
        return tiles if tiles is not None else plain

    @property
    def batched_kernel(self) -> str | None:
        """The extern kernel a batched compiled decode step multiplies this matrix with
        (``runner/decode_graph.batched_graph_capable``): "int8_tiles", "quant_tiles", "packed", or None."""
        return self.method.batched_kernel

    def pack(self, plain: torch.Tensor, keep_plain: bool, halves: bool = False, eager_tiles: bool = False) -> bool:
        """Add oneDNN's packed copy of ``plain`` where the device prepacks its dtype (whole, or
        its top and bottom halves); with ``keep_plain`` (compiled decode steps read the
        matrix) or ``eager_tiles`` (eager decode steps multiply a few rows, ``tiles_take``) also
        its bf16 tiles where the bf16 kernel takes them. Returns whether ``plain`` is no longer
        needed for matmuls: packed, and not kept or tiled."""
        if self.method is not methods.PLAIN or not plain.numel() or not mkldnn_packing_available(plain):
            return False
        if halves:
            top, bottom = plain.split(self.rows // 2)
            self.packed_halves = (pack_weight(top), pack_weight(bottom))
        else:
            self.packed = pack_weight(plain)
        self.method = methods.PACKED
        if keep_plain:
            return self._set_bf16_tiles(plain)
        if eager_tiles:
            self.eager_tiles = self._set_bf16_tiles(plain)
        return True

    def graph_tiles(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """The bf16 tiles a batched compiled decode step's call may multiply for a decode-sized
        batch (``packed_linear``), where the tile kernel takes ``x`` and ``bias``; else None."""
        tiles = self.bf16
        if tiles is None or x.dtype != torch.bfloat16 or (bias is not None and bias.dtype != x.dtype):
            return None
        return tiles.tiles

    def tiles_take(self, x: torch.Tensor) -> bool:
        """Whether an eager matmul of ``x`` multiplies the bf16 tiles rather than the packed copy:
        tiles packed for eager steps (``pack``'s ``eager_tiles``) and a decode-sized bfloat16 CPU
        batch (at most ``EAGER_TILE_ROWS`` rows), where the tile kernel streams the matrix faster
        than oneDNN's GEMM."""
        return (self.eager_tiles and x.dtype == torch.bfloat16 and x.device.type == "cpu"
                and not torch.compiler.is_compiling() and x.numel() <= EAGER_TILE_ROWS * self.cols)

    def _set_bf16_tiles(self, plain: torch.Tensor) -> bool:
        """Keep ``plain``'s bf16 tiles where the kernel takes them (bfloat16 on a CPU where
        ``bf16_linear`` runs, an even number of columns). Returns whether it did."""
        if plain.dtype != torch.bfloat16 or plain.device.type != "cpu" or plain.shape[1] % 2 \
                or not bf16_kernel.available():
            return False
        self.register_buffer("bf16_tiles", bf16_kernel.pack(plain.detach()), persistent=False)
        return True

    def use_int8(self, weight: Int8Weight) -> None:
        """Multiply by these int8 weights from now on (as the int8 kernel's tiles where it
        runs); a packed copy goes."""
        if tuple(weight.qweight.shape) != (self.rows, self.cols):
            raise ValueError(f"int8 weight of shape {tuple(weight.qweight.shape)} for a matrix of "
                             f"{self.rows} x {self.cols}")
        for name in ("tiles", "qweight", "scales"):
            self._buffers.pop(name, None)
        if tiles_fit(weight):
            tiled = Int8Tiles.pack(weight)
            self.register_buffer("tiles", tiled.tiles, persistent=False)
            self.register_buffer("scales", tiled.scales, persistent=False)
            self.method = methods.INT8_TILES
        else:
            self.register_buffer("qweight", weight.qweight, persistent=False)
            self.register_buffer("scales", weight.scales, persistent=False)
            self.method = methods.INT8
        self.packed = self.packed_halves = None

    def refresh(self, plain: torch.Tensor) -> None:
        """After a weight update: recompute every form this matrix has from ``plain`` (its
        new values, [rows, cols]) and write each into the tensor it replaces, so a compiled
        step or kernel that holds those tensors reads the new weights. int8 keeps its layout
        (per channel, or per group as a GGUF's Q8_0 blocks) and is quantized afresh."""
        if tuple(plain.shape) != (self.rows, self.cols):
            raise ValueError(f"new weight of shape {tuple(plain.shape)} for a matrix of {self.rows} x {self.cols}")
        plain = plain.detach()
        if self.packed is not None:
            self.packed.copy_(pack_weight(plain))
        if self.packed_halves is not None:
            for packed, half in zip(self.packed_halves, plain.split(self.rows // 2), strict=True):
                packed.copy_(pack_weight(half.contiguous()))
        int8 = self.int8
        if int8 is not None:
            fresh = quantize_int8(plain, int8.group)
            if isinstance(int8, Int8Tiles):
                tiled = Int8Tiles.pack(fresh)
                self._buffers["tiles"].copy_(tiled.tiles)
                self._buffers["scales"].copy_(tiled.scales)
            else:
                self._buffers["qweight"].copy_(fresh.qweight)
                self._buffers["scales"].copy_(fresh.scales)
        quant = self.quant
        if quant is not None:
            if self.input_index is not None:  # the tiles' column order (``use_column_order``)
                plain = plain[:, self.input_index]
            for old, new in zip(quant.tensors, requantize_like(plain, quant), strict=True):
                old.copy_(new)
        tiles = self._buffers.get("bf16_tiles")
        if tiles is not None:
            tiles.copy_(bf16_kernel.pack(plain.to(tiles.dtype)))
        fp32 = self.fp32
        if fp32 is not None:
            fp32.copy_(plain.float())

    def use_batch_invariant(self, plain: torch.Tensor) -> bool:
        """From now on multiply with a kernel whose result for a row is the same bits whatever
        the other rows are (the batch-invariant mode): ``bf16_linear`` over this matrix's bf16
        tiles where that kernel takes ``plain`` (``_set_bf16_tiles``; its sums run over K in a
        fixed order, each row on its own), else ``kernels/invariant_linear`` over ``plain``. An
        LM head's float32 copy (``fp32``) stays what the head multiplies, by the latter. Call
        before ``pack``, which then adds nothing; int8 weights are refused (ValueError), as the
        mode has no invariant int8 matmul. Returns whether ``plain`` is no longer needed (tiled)."""
        if self.quantized is not None:
            raise ValueError("--batch-invariant does not support quantized weights (--quantization int8, or a GGUF "
                             "file's quantized matrices: load it with --quantization none)")
        if self.packed is not None or self.packed_halves is not None or self.bf16 is not None:
            raise ValueError("use_batch_invariant must come before the weights are packed")
        self.method = methods.INVARIANT
        return self.fp32 is None and self._set_bf16_tiles(plain)

    def quantize(self, plain: torch.Tensor) -> None:
        """``use_int8`` with per-channel int8 quantized from ``plain``."""
        self.use_int8(quantize_int8(plain))

    @property
    def invariant(self) -> bool:
        """The batch-invariant mode's kernels multiply this matrix (``use_batch_invariant``)."""
        return self.method is methods.INVARIANT

    def matmul(self, x: torch.Tensor, plain: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ matrix^T (+ bias) by the method the forms chose at load (``linear_methods``)."""
        return self.method.apply(self, x, plain, bias)

    def memory_bytes(self, dtype: torch.dtype) -> int:
        """Bytes these forms hold beside the plain tensor (a packed copy counted as the float matrix)."""
        total = sum(t.nbytes for t in self._buffers.values() if t is not None)
        if self.packed is not None or self.packed_halves is not None:
            total += self.rows * self.cols * dtype.itemsize
        return total

    def decode_bytes(self, dtype: torch.dtype) -> int:
        """Bytes one decode step reads for this matrix: the float32 copy, the int8 weights, or the
        float matrix."""
        if self.fp32 is not None:
            return self.fp32.nbytes
        quantized = self.quantized
        return quantized.nbytes if quantized is not None else self.rows * self.cols * dtype.itemsize
