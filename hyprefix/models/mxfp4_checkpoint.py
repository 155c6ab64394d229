"""An HF checkpoint whose MoE experts are MXFP4 blocks (``quantization_config.quant_method``
"mxfp4": gpt-oss as the hub has it), read like a GGUF file (``loader.load_block_source``): the
expert stacks as ``gguf_blocks.BlockMatrix`` of GGUF's MXFP4 blocks, which stay in the kernels'
MX4 tiles (4.25 bits a weight, as on disk), and every other tensor as it is.

The hub stores a stack as ``<name>_blocks`` uint8 [E, rows, cols / 32, 16] and ``<name>_scales``
uint8 [E, rows, cols / 32]: per 32 columns of a row 16 bytes of E2M1 codes (byte j: element 2j
in its low nibble, 2j + 1 in its high one) and an E8M0 scale e, the value ``fp4[code] *
2^(e - 127)``. GGUF's MXFP4 block is the scale byte, then byte j holding elements j (low) and
j + 16 (high), the value ``MXFP4_VALUES[code] * 2^(e - 128)`` (the E2M1 values doubled): the same
numbers, the nibbles reordered (llama.cpp's converter does the same). The stacks are offered in
their rows-first form, ``<name>.weight`` [E, rows, cols], which the model's ``converted`` takes
(gpt-oss: ``GptOssForCausalLM``); where the kernels do not run they are dequantized to floats."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from hyprefix.kernels import quant_linear as quant_kernel
from hyprefix.models.gguf_blocks import BlockMatrix

BLOCKS, SCALES = "_blocks", "_scales"


def is_mxfp4(hf_config) -> bool:
    """Whether the checkpoint's config says its experts are MXFP4 blocks."""
    quant = getattr(hf_config, "quantization_config", None) or {}
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    return str(method) == "mxfp4"


def _codes(blocks: torch.Tensor) -> torch.Tensor:
    """The hub's blocks [..., G, 16] as E2M1 codes [..., G, 32] in element order."""
    return torch.stack([blocks & 0xF, blocks >> 4], dim=-1).flatten(-2)


def ggml_rows(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The hub's blocks [..., G, 16] and scales [..., G] as GGUF MXFP4 rows: uint8 [n, G * 17]."""
    codes = _codes(blocks)
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    rows = torch.cat([scales.unsqueeze(-1), packed], dim=-1)
    return rows.reshape(-1, rows.shape[-2] * 17)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The hub's blocks and scales as float32 [..., G * 32]."""
    values = torch.tensor(quant_kernel.MXFP4_VALUES, dtype=torch.float32)[_codes(blocks).long()]
    return torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 128).flatten(-2)


class Mxfp4Checkpoint:
    """The safetensors files of ``path``: ``block_matrices`` the MXFP4 stacks, ``floats`` the rest
    (module docstring). Raises ValueError for a ``_blocks`` tensor without its ``_scales`` or
    outside a MoE block's experts (the only place gpt-oss quantizes)."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        self.files: dict[str, Path] = {}
        self.shapes: dict[str, list[int]] = {}
        for file in sorted(path.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    self.files[name] = file
                    self.shapes[name] = list(f.get_slice(name).get_shape())
        self.stacks = [name.removesuffix(BLOCKS) for name in self.files if name.endswith(BLOCKS)]
        lone = [s for s in self.stacks if s + SCALES not in self.files]
        if lone:
            raise ValueError(f"MXFP4 checkpoint {path}: {lone[0]}{BLOCKS} has no {SCALES}")
        elsewhere = [s for s in self.stacks if ".experts." not in s]
        if elsewhere:
            raise ValueError(f"MXFP4 checkpoint {path}: {elsewhere[0]} is quantized outside the experts; "
                             "only expert stacks are read as MXFP4")

    def _stack(self, stack: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A stack's (blocks, scales) as the hub stores them."""
        from safetensors import safe_open

        out = []
        for name in (stack + BLOCKS, stack + SCALES):
            with safe_open(str(self.files[name]), framework="pt") as f:
                out.append(f.get_tensor(name))
        return out[0], out[1]

    def check(self, net: torch.nn.Module) -> None:
        """Nothing to check before allocating: ``load_weights`` names any tensor that does not fit."""

    def __len__(self) -> int:
        """How many tensors ``floats`` gives with nothing skipped."""
        return len(self.files) - len(self.stacks)

    def block_matrices(self) -> list[BlockMatrix]:
        """Each stack as GGUF MXFP4 rows (none where the quant kernels do not run)."""
        if not quant_kernel.available():
            return []
        out = []
        for stack in self.stacks:
            experts, rows, groups = self.shapes[stack + BLOCKS][:3]
            out.append(BlockMatrix(f"{stack}.weight", "MXFP4", experts * rows, groups * 32,
                                   lambda s=stack: ggml_rows(*self._stack(s)), experts=experts))
        return out

    def floats(self, skip: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor but the blocks and scales, each file opened once, and each stack not in
        ``skip`` dequantized under its rows-first name."""
        from safetensors import safe_open

        stacks = set(self.stacks)
        for file in dict.fromkeys(self.files.values()):
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    base = name.removesuffix(BLOCKS).removesuffix(SCALES)
                    if base not in stacks:
                        yield name, f.get_tensor(name)
                    elif name.endswith(BLOCKS) and f"{base}.weight" not in skip:
                        yield f"{base}.weight", dequantize(*self._stack(base))
