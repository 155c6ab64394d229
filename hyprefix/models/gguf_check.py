"""Checks of a GGUF file against the model built for it, run on the meta device before any
weight is allocated (``loader.load_model``): every tensor's type readable, and every parameter
of the model given a tensor. Each failure is a ValueError naming the file, the tensors or
parameters, and what is supported. (Shapes are checked as the tensors are copied in:
``CausalLM.load_weights`` names the tensor, its shape and the one expected.)"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping

import numpy as np
import torch


@functools.cache
def readable(kind) -> bool:
    """Whether the ``gguf`` package dequantizes tensors of this ``GGMLQuantizationType`` (one
    zero block of it, tried once)."""
    import gguf
    from gguf.constants import GGML_QUANT_SIZES

    if kind not in GGML_QUANT_SIZES:
        return False
    try:
        gguf.quants.dequantize(np.zeros((1, GGML_QUANT_SIZES[kind][1]), dtype=np.uint8), kind)
    except NotImplementedError:
        return False
    return True


def check_types(file_name: str, tensors: Mapping[str, object]) -> None:
    """Every tensor (``gguf.ReaderTensor`` by name) of a type that reads; else a ValueError
    naming each unreadable type with its first tensors, and the types that read."""
    import gguf

    unreadable: dict[str, list[str]] = {}
    for name, tensor in tensors.items():
        if not readable(tensor.tensor_type):
            unreadable.setdefault(tensor.tensor_type.name, []).append(name)
    if unreadable:
        kinds = "; ".join(f"type {kind} cannot be read; tensors of that type: {_listed(names)}"
                          for kind, names in unreadable.items())
        supported = ", ".join(t.name for t in gguf.GGMLQuantizationType if readable(t))
        raise ValueError(f"cannot load the GGUF file {file_name}: {kinds} (types that read: {supported})")


def check_coverage(file_name: str, net: torch.nn.Module, names: Iterable[str]) -> None:
    """Every parameter of ``net`` (a ``CausalLM``, on the meta device) is the target of one of
    the file's tensors (``names``: transformers names) for each of its shards; else a ValueError
    naming the parameters the file does not give."""
    given: dict[str, set[int]] = {}
    expected: dict[str, int] = {}
    for hf_name in names:
        target = net.map_name(hf_name)
        if target is None:
            continue
        param, shard, sizes = target
        given.setdefault(param, set()).add(0 if shard is None else shard)
        expected[param] = len(sizes) if sizes else 1
    missing = [param for param, _ in net.named_parameters()
               if param not in given or len(given[param]) < expected[param]]
    if missing:
        raise ValueError(f"GGUF file {file_name} has no tensor for the model's {_listed(missing)}")


def _listed(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" ... ({len(names)} in all)" if len(names) > 4 else "")
