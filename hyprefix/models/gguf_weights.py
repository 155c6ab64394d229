"""A GGUF file's tensors, read straight from its memory map (``gguf.GGUFReader``) under
transformers' parameter names: float tensors as float32, and the quantized matrices the kernels
take kept in their blocks' numbers (no float copy of a quantized matrix, no transformers
dequantize round-trip).

Names and the per-tensor fix-ups are transformers' (``get_gguf_hf_weights_map`` and its
``TENSOR_PROCESSORS``: Llama's q/k rows permuted back from llama.cpp's interleaved RoPE order,
Gemma's norms shifted by one); a quantized matrix takes a fix-up only where it is a row
permutation, which is applied while packing.

Kept quantized (``block_matrices``, loaded by ``gguf_blocks``), by type:

* Q8_0 -> the int8 kernel's tiles with the file's int8 values and one scale per 32; Q5_0
  likewise, exactly (its 5-bit codes minus 16 are int8 values, its float16 d the scale);
* Q4_0, Q4_1, Q4_K, Q6_K -> ``kernels/quant_tiles.h``'s Q4, Q4K or Q6 tiles, the same numbers;
* Q5_K -> Q4 tiles: each group of 32 rounded from 5 to 4 bits (the nearest kernel format at no
  more bytes than the file's; ``docs/quantization.md`` measures what it costs).

Every other type (F32, F16, BF16, Q2_K, Q3_K, IQ*, ...) is dequantized to float32 by ``gguf``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from hyprefix.kernels import quant_linear as quant_kernel
from hyprefix.models.gguf_blocks import KEPT_TYPES, BlockMatrix
from hyprefix.models.gguf_check import check_coverage, check_sizes, check_types


class GGUFWeights:
    """The tensors of one GGUF file under transformers' names, for ``hf_config``'s model."""

    def __init__(self, path: Path, hf_config, architecture: str) -> None:
        import gguf
        from transformers.modeling_gguf_pytorch_utils import (
            TENSOR_PROCESSORS,
            TensorProcessor,
            get_gguf_hf_weights_map,
        )

        from hyprefix.models.loader import _meta_reference

        self.path = path
        self.reader = gguf.GGUFReader(str(path))
        self.processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=hf_config.to_dict())
        self.names = get_gguf_hf_weights_map(_meta_reference(hf_config), self.processor)
        self.tensors = {t.name: t for t in self.reader.tensors if t.name in self.names}

    def __len__(self) -> int:
        """How many transformers tensors this reader gives."""
        return len(self.tensors)

    def _rows(self, gguf_name: str, n: int) -> np.ndarray | None:
        """The fix-up of a matrix as a row order (row i of the result is the file's row
        rows[i]); None where the fix-up is no row permutation (such a matrix is read as floats)."""
        order = np.arange(n, dtype=np.int64).reshape(n, 1)
        result = self.processor.process(weights=order, name=gguf_name).weights
        rows = np.asarray(result).reshape(-1)
        return rows if rows.shape == (n,) and np.array_equal(np.sort(rows), order[:, 0]) else None

    def block_matrices(self) -> list[BlockMatrix]:
        """The file's matrices that can stay in their blocks here (``gguf_blocks``): 2-D, of a
        type the kernels take (which run here), whose fix-up is a row order."""
        if not quant_kernel.available():  # every kept matrix becomes ``QuantTiles``, Q8_0's too: its ops
            return []
        out = []
        for gguf_name, tensor in self.tensors.items():
            kind = tensor.tensor_type.name
            if tensor.data.ndim != 2 or kind not in KEPT_TYPES:
                continue
            rows = self._rows(gguf_name, tensor.data.shape[0])
            if rows is not None:
                out.append(BlockMatrix(self.names[gguf_name], kind, len(rows), int(tensor.shape[0]),
                                       lambda t=tensor, r=rows: _rows_of(t, r)))
        return out

    def check(self, net: torch.nn.Module) -> None:
        """Before anything is allocated (``gguf_check``): every type reads, every parameter of
        ``net`` (on the meta device) is given."""
        check_types(self.path.name, self.tensors)
        check_coverage(self.path.name, net, [self.names[name] for name in self.tensors])
        check_sizes(self.path.name, net, ((self.names[name], torch.empty(_shape(t), device="meta"))
                                          for name, t in self.tensors.items()), exact=False,
                    sources={self.names[name]: name for name in self.tensors})

    def floats(self, skip: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor but those named in ``skip`` (transformers names), as float32 with its
        fix-up applied."""
        import gguf

        for gguf_name, tensor in self.tensors.items():
            hf_name = self.names[gguf_name]
            if hf_name in skip:
                continue
            try:
                values = gguf.dequantize(tensor.data, tensor.tensor_type)
            except NotImplementedError:  # a type gguf cannot dequantize (``check`` refuses such a file first)
                check_types(self.path.name, self.tensors)  # names the types and their tensors
                raise
            values = self.processor.process(weights=values, name=gguf_name).weights
            yield hf_name, _tensor(values).float()


def _rows_of(tensor, rows: np.ndarray) -> torch.Tensor:
    """A quantized tensor's blocks (uint8 [rows, bytes a row]) in the order ``rows``: a view of
    the file's memory map where that is the file's own order (``gguf_blocks`` copies what it keeps)."""
    raw = _tensor(tensor.data)
    return raw if np.array_equal(rows, np.arange(len(rows))) else raw[torch.from_numpy(rows)]


def _shape(tensor) -> tuple[int, ...]:
    """A tensor's shape in torch's order (gguf lists dimensions innermost first)."""
    return tuple(int(n) for n in reversed(tensor.shape.tolist()))


def _tensor(values: np.ndarray) -> torch.Tensor:
    """A torch view of a (read-only) memory-mapped array: the caller copies what it keeps."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "the given NumPy array is not writable"
        return torch.from_numpy(np.ascontiguousarray(values))
