"""The disk tier's worker side: bytes in and out of the engine's cache tensors.

A KV block's payload is the K then V rows of that block for every attention layer
whose K/V lives in the main pool, layer by layer, in the pool's dtype; a sliding-window
block's payload is the same for the layers whose K/V lives in the window's own pool; a
state checkpoint's payload is the conv then matrix state of every recurrent layer in
that checkpoint slot. ``layout`` describes all three (dtype, block size, shapes): the
disk store keeps files of another layout apart, so a payload always has the size and
meaning its reader expects.

Contract: reads copy (the copy is taken before the slot can be reused, and the caller
may hand it to another thread); writes fill the block or slot completely, and may run on
another thread than the engine's (into blocks and slots no step reads meanwhile).
"""

from __future__ import annotations

import numpy as np
import torch

from hyprefix.models.recurrent_state import RecurrentLayerState


def _raw(tensors: list[torch.Tensor]) -> bytes | memoryview:
    """The tensors' bytes, one after another, in a buffer of their own (one copy on a CPU)."""
    if not tensors:
        return b""
    if all(t.device.type == "cpu" for t in tensors):
        out = np.empty(sum(t.numel() * t.element_size() for t in tensors), dtype=np.uint8)
        offset = 0
        for t in tensors:
            raw = t.reshape(-1).view(torch.uint8).numpy()
            out[offset:offset + raw.size] = raw
            offset += raw.size
        return memoryview(out)
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])
    return flat.cpu().numpy().tobytes()


def _fill(targets: list[torch.Tensor], payload: bytes | memoryview) -> None:
    """Write ``payload`` through ``targets`` seen as bytes (a byte slice of the payload need not
    be aligned to a target's dtype). On a CPU through numpy, which starts no OpenMP workers:
    imports run on a thread of their own (``disk/connector.py``), where torch's parallel copies
    would start a second pool beside the engine thread's (``openmp.py``)."""
    data = np.frombuffer(payload, dtype=np.uint8)
    expected = sum(t.numel() * t.element_size() for t in targets)
    if data.size != expected:
        raise ValueError(f"payload of {data.size} bytes for a layout of {expected}")
    offset = 0
    for t in targets:
        n = t.numel() * t.element_size()
        raw = t.view(-1).view(torch.uint8)
        if raw.device.type == "cpu":
            raw.numpy()[:] = data[offset:offset + n]
        else:
            raw.copy_(torch.from_numpy(data[offset:offset + n].copy()))
        offset += n


_PAGE = 4096  # bytes of the smallest memory page


def _block_bytes(layers: list[tuple[torch.Tensor, ...]]) -> int:
    return sum(t[0].numel() * t.element_size() for layer in layers for t in layer)


def _block_layout(layers: list[tuple[torch.Tensor, ...]]) -> str:
    return ";".join(f"{tuple(layer[0].shape[1:])}:{layer[0].dtype}" for layer in layers)


def _distinct(pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """A layer's cache tensors, each once: (K, V), or (latent,) where V is K (``KVLayout.latent``),
    so a latent block is written to and read from disk once."""
    return pair[:1] if pair[1] is pair[0] else pair


class BlockIO:
    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], main_pool_layers: list[int],
                 recurrent_states: list[RecurrentLayerState], block_size: int,
                 window_pool_layers: list[int] = ()) -> None:
        self._kv = [_distinct(kv_caches[i]) for i in main_pool_layers]
        self._swa = [_distinct(kv_caches[i]) for i in window_pool_layers]
        self._states = recurrent_states
        self.kv_block_bytes = _block_bytes(self._kv)
        self.swa_block_bytes = _block_bytes(self._swa)
        self.state_bytes = sum(s.ckpt_conv[0].numel() * s.ckpt_conv.element_size()
                               + s.ckpt_matrix[0].numel() * s.ckpt_matrix.element_size() for s in self._states)
        states = ";".join(f"{tuple(s.ckpt_conv.shape[1:])}:{s.ckpt_conv.dtype}/{tuple(s.ckpt_matrix.shape[1:])}:"
                          f"{s.ckpt_matrix.dtype}" for s in self._states)
        self.layout = f"block_size={block_size}|kv=[{_block_layout(self._kv)}]|states=[{states}]"
        if self._swa:  # (models without a window pool keep the layout, and so the files, they had)
            self.layout += f"|swa=[{_block_layout(self._swa)}]"

    def touch(self) -> int:
        """Write every memory page of the tensors loads write into (main and window KV pools,
        checkpoint slots) once, now; returns their bytes. Their pages are otherwise first
        touched by the import copier, beside running steps, and a first touch can be slow (a
        huge page zeroed, a VM's memory backed by its host), and faults on one thread stall
        another's steps (docs/architecture.md, "Disk tier")."""
        tensors = [t for pair in self._kv + self._swa for t in pair]
        tensors += [t for s in self._states for t in (s.ckpt_conv, s.ckpt_matrix)]
        with torch.no_grad():
            for t in tensors:
                if t.device.type == "cpu" and t.numel():
                    t.view(-1).view(torch.uint8)[::_PAGE].zero_()
        return sum(t.nbytes for t in tensors)

    def read_blocks(self, window: bool, block_ids: list[int]) -> list[bytes | memoryview]:
        """``read_kv`` (``read_swa`` if ``window``) of many blocks: one gather per layer, not a
        copy per layer and block."""
        layers = self._swa if window else self._kv
        if not block_ids:
            return []
        if not layers:
            return [b""] * len(block_ids)
        if len(block_ids) == 1 or layers[0][0].device.type != "cpu":
            read = self.read_swa if window else self.read_kv
            return [read(b) for b in block_ids]
        index = torch.tensor(block_ids, dtype=torch.long)
        n = len(block_ids)
        rows = torch.cat([t.index_select(0, index).view(n, -1).view(torch.uint8) for pair in layers for t in pair],
                         dim=1)
        data = rows.numpy()
        return [memoryview(data[i]) for i in range(n)]

    def read_kv(self, block_id: int) -> bytes | memoryview:
        return _raw([t[block_id] for pair in self._kv for t in pair])

    def write_kv(self, block_id: int, payload: bytes | memoryview) -> None:
        _fill([t[block_id] for pair in self._kv for t in pair], payload)

    def read_swa(self, block_id: int) -> bytes | memoryview:
        return _raw([t[block_id] for pair in self._swa for t in pair])

    def write_swa(self, block_id: int, payload: bytes | memoryview) -> None:
        _fill([t[block_id] for pair in self._swa for t in pair], payload)

    def read_state(self, slot: int) -> bytes | memoryview:
        return _raw([t[slot] for s in self._states for t in (s.ckpt_conv, s.ckpt_matrix)])

    def write_state(self, slot: int, payload: bytes | memoryview) -> None:
        _fill([t[slot] for s in self._states for t in (s.ckpt_conv, s.ckpt_matrix)], payload)

    def write(self, pool: str, index: int, payload: bytes | memoryview) -> None:
        """Fill block (or checkpoint slot) ``index`` of ``pool`` ("kv", "swa" or "state": the
        coordinator's pool names) with ``payload``."""
        {"kv": self.write_kv, "swa": self.write_swa, "state": self.write_state}[pool](index, payload)
