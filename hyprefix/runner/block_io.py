"""Bytes in and out of the engine's cache tensors, for the disk tier (``cache/disk_tier.py``).

A KV block's payload is the K then V rows of that block for every attention layer
whose K/V lives in the main pool, layer by layer, in the pool's dtype; a sliding-window
block's payload is the same for the layers whose K/V lives in the window's own pool; a
state checkpoint's payload is the conv then matrix state of every recurrent layer in
that checkpoint slot. ``layout`` describes all three (dtype, block size, shapes): the
disk store keeps files of another layout apart, so a payload always has the size and
meaning its reader expects.

Contract: reads copy (the copy is taken before the slot can be reused, and the caller
may hand it to another thread); writes fill the block or slot completely.
"""

from __future__ import annotations

import torch

from hyprefix.models.recurrent_state import RecurrentLayerState


def _raw(tensors: list[torch.Tensor]) -> bytes:
    if not tensors:
        return b""
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])
    return flat.cpu().numpy().tobytes()


def _fill(targets: list[torch.Tensor], payload: bytes | memoryview) -> None:
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8)
    offset = 0
    for t in targets:
        n = t.numel() * t.element_size()
        # The target seen as bytes: a byte slice of the payload need not be aligned to its dtype.
        t.view(-1).view(torch.uint8).copy_(data[offset:offset + n])
        offset += n
    if offset != data.numel():
        raise ValueError(f"payload of {data.numel()} bytes for a layout of {offset}")


def _block_bytes(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    return sum(2 * k[0].numel() * k.element_size() for k, _ in layers)


class BlockIO:
    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], main_pool_layers: list[int],
                 recurrent_states: list[RecurrentLayerState], block_size: int,
                 window_pool_layers: list[int] = ()) -> None:
        self._kv = [kv_caches[i] for i in main_pool_layers]
        self._swa = [kv_caches[i] for i in window_pool_layers]
        self._states = recurrent_states
        self.kv_block_bytes = _block_bytes(self._kv)
        self.swa_block_bytes = _block_bytes(self._swa)
        self.state_bytes = sum(s.ckpt_conv[0].numel() * s.ckpt_conv.element_size()
                               + s.ckpt_matrix[0].numel() * s.ckpt_matrix.element_size() for s in self._states)
        kv = ";".join(f"{tuple(k.shape[1:])}:{k.dtype}" for k, _ in self._kv)
        states = ";".join(f"{tuple(s.ckpt_conv.shape[1:])}:{s.ckpt_conv.dtype}/{tuple(s.ckpt_matrix.shape[1:])}:"
                          f"{s.ckpt_matrix.dtype}" for s in self._states)
        self.layout = f"block_size={block_size}|kv=[{kv}]|states=[{states}]"
        if self._swa:  # (models without a window pool keep the layout, and so the files, they had)
            self.layout += "|swa=[" + ";".join(f"{tuple(k.shape[1:])}:{k.dtype}" for k, _ in self._swa) + "]"

    def read_kv(self, block_id: int) -> bytes:
        return _raw([t[block_id] for pair in self._kv for t in pair])

    def write_kv(self, block_id: int, payload: bytes | memoryview) -> None:
        _fill([t[block_id] for pair in self._kv for t in pair], payload)

    def read_swa(self, block_id: int) -> bytes:
        return _raw([t[block_id] for pair in self._swa for t in pair])

    def write_swa(self, block_id: int, payload: bytes | memoryview) -> None:
        _fill([t[block_id] for pair in self._swa for t in pair], payload)

    def read_state(self, slot: int) -> bytes:
        return _raw([t[slot] for s in self._states for t in (s.ckpt_conv, s.ckpt_matrix)])

    def write_state(self, slot: int, payload: bytes | memoryview) -> None:
        _fill([t[slot] for s in self._states for t in (s.ckpt_conv, s.ckpt_matrix)], payload)
