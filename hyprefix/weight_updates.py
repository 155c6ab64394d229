"""Weights loaded into the running model, in place (``Engine.update_weights``): a checkpoint
directory or GGUF file of the same architecture and shapes, or (name, tensor) pairs with the
checkpoint's names (a trainer's state dict)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

from hyprefix.errors import RequestError
from hyprefix.models.loader import iter_gguf, iter_safetensors, load_config

log = logging.getLogger("hyprefix")

Weights = str | os.PathLike | Iterable[tuple[str, torch.Tensor]]


class WeightUpdater:
    """Owns the weights' version and the model identity it makes: ``identity`` names the
    weights running now, the root of every block hash (``on_identity`` is told each new one).

    The weight version (the caller's, else the update's number) becomes part of that identity,
    so no block or state checkpoint computed by the old weights can be hit again; they age out
    of the LRU."""

    def __init__(self, model: torch.nn.Module, hf_config, loaded_identity: str, weight_version: str,
                 on_identity: Callable[[str], None]) -> None:
        self.model = model
        self.hf_config = hf_config
        self.loaded_identity = loaded_identity
        self.identity = loaded_identity
        self.weight_version = weight_version
        self.num_updates = 0
        self._on_identity = on_identity

    def update(self, weights: Weights, weight_version: str | None = None) -> dict[str, object]:
        """Everything is read and checked before anything changes: a mismatch raises
        ``RequestError`` (param ``model_path``) and leaves the model as it was."""
        t0 = time.perf_counter()
        if isinstance(weights, str | os.PathLike):
            weights = self._checkpoint_tensors(Path(weights))
        try:
            count = self.model.update_weights(weights)
        except ValueError as exc:
            raise RequestError(f"the new weights do not fit this model: {exc}", param="model_path") from exc
        self.num_updates += 1
        self.weight_version = weight_version if weight_version is not None else str(self.num_updates)
        self.identity = f"{self.loaded_identity}|weights={self.weight_version}#{self.num_updates}"
        self._on_identity(self.identity)
        seconds = time.perf_counter() - t0
        log.info("updated %d weight tensors to version %r in %.2fs", count, self.weight_version, seconds)
        return {"weight_version": self.weight_version, "num_parameters": count, "seconds": seconds}

    def _checkpoint_tensors(self, path: Path) -> Iterator[tuple[str, torch.Tensor]]:
        """A checkpoint's tensors, after checking it is one of this model's architecture."""
        if not path.exists():
            raise RequestError(f"no checkpoint at {path}", param="model_path")
        try:
            config = load_config(path)
        except (OSError, ValueError) as exc:
            raise RequestError(f"{path} is not a checkpoint this server reads: {exc}", param="model_path") from exc
        for key in ("model_type", "architectures"):
            theirs, mine = getattr(config, key, None), getattr(self.hf_config, key, None)
            if theirs != mine and (key == "model_type" or (theirs and mine)):  # a GGUF may name no architectures
                raise RequestError(f"the checkpoint at {path} is another architecture ({key} {theirs!r}, this "
                                   f"model's {mine!r})", param="model_path")
        return iter_gguf(path, config) if path.suffix == ".gguf" else iter_safetensors(path)
