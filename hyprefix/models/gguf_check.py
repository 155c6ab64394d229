"""Checks of a GGUF file against the model built for it, run on the meta device before any
weight is allocated (``loader.load_model``): every tensor's type readable, every parameter of
the model given a tensor, and every tensor of the size its parameter (or shard) takes. Each
failure is a ValueError naming the file, the tensors or parameters, and what is expected or
supported. (``CausalLM.load_weights`` checks the exact shapes again as it copies.)"""

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
        kinds = "; ".join(f"type {kind} cannot be read; tensors of that type: {listed(names)}"
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
        raise ValueError(f"GGUF file {file_name} has no tensor for the model's {listed(missing)}")


def check_sizes(file_name: str, net: torch.nn.Module, tensors: Iterable[tuple[str, torch.Tensor]],
                exact: bool, sources: Mapping[str, str]) -> None:
    """Every tensor (transformers name, a meta tensor of its shape) through the model's
    ``converted`` fits the parameter (or shard) it maps to: the same shape with ``exact`` (a
    reader that knows the final shapes), else the same number of elements (a reader whose
    fix-ups may still reshape); one row per head copied into every head's row is allowed, as
    ``load_weights`` does. Else a ValueError naming the tensor (``sources``: transformers name ->
    the file's tensors it is made of), its shape and the expected one."""
    params = {name: p for name, p in net.named_parameters()}
    for name, converted, tensor in _converted(file_name, net, tensors, sources):
        target = net.map_name(converted)
        if target is None or target[0] not in params:
            continue
        param, shard, sizes = target
        shape = params[param].shape
        if shard is not None and sizes is not None:
            shape = torch.Size((sizes[shard], *shape[1:]))
        per_head = len(shape) == 2 and tensor.dim() == 1 and shape[1] == tensor.shape[0]
        fits = tensor.shape == shape if exact else tensor.numel() == shape.numel()
        if not (fits or per_head):
            origin = f" (the file's {sources[name]})" if name in sources else ""
            raise ValueError(f"GGUF file {file_name}: tensor {name!r}{origin} has shape {tuple(tensor.shape)}, the "
                             f"model expects {tuple(shape)} ({param})")


def _converted(file_name: str, net: torch.nn.Module, tensors: Iterable[tuple[str, torch.Tensor]],
               sources: Mapping[str, str]) -> Iterable[tuple[str, str, torch.Tensor]]:
    """(transformers name, the name ``map_name`` reads, tensor) for what the model's ``converted``
    makes of each tensor on its own; a shape its row moves cannot take is a ValueError naming the
    tensor."""
    for name, tensor in tensors:
        try:
            made = list(net.converted([(name, tensor)]))
        except RuntimeError as exc:
            origin = f" (the file's {sources[name]})" if name in sources else ""
            raise ValueError(f"GGUF file {file_name}: tensor {name!r}{origin} of shape {tuple(tensor.shape)} does not "
                             f"fit the model: {exc}") from exc
        for converted, part in made:
            yield name, converted, part


def listed(names: list[str], first: int = 4) -> str:
    """The first ``first`` names, and how many there are in all when there are more."""
    return ", ".join(names[:first]) + (f" ... ({len(names)} in all)" if len(names) > first else "")
