"""Weights in transparent huge pages, K/V caches in lazily mapped small pages (CPUs).

A decode step streams every weight once, in many short reads (SmolLM2-135M's layer
weights are 0.3-1.8 MB each); with 4 KiB pages each read crosses hundreds of page
edges, where the TLB misses and the hardware prefetchers stop. Where THP is in
"madvise" mode (the common default) torch's allocator never asks for huge pages, so
the weights are moved, once, into one private anonymous mapping advised with
``MADV_HUGEPAGE`` and starting on a 2 MiB boundary, in forward order. Elsewhere (THP
off, another OS, another device) the weights stay where they are.

The K/V caches go into one private anonymous mapping advised ``MADV_NOHUGEPAGE``
(``lazy_zeros``): zero-filled by the kernel and mapped 4 KiB at a time as blocks are
first written, so an idle pool costs no memory and a block's first write costs a
small-page fault (~0.2 ms a MiB on a 2-core Zen 5 VM), where a huge-page fault with THP's
``defrag=madvise`` compacts memory first (1.2-2.3 ms a MiB, docs/perf-log.md), inside
the prefill that writes the block. Decode reads K/V no slower from small pages.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
from collections import Counter
from pathlib import Path

import torch

log = logging.getLogger("hyprefix.runner")

HUGE_PAGE = 2 << 20
_ALIGN = 64  # each tensor starts on a cache line
_THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_available() -> bool:
    """Whether this process can ask for transparent huge pages (Linux, THP not "never")."""
    if sys.platform != "linux" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in _THP_SETTING.read_text()
    except OSError:
        return False


class HugePageArena:
    """One private anonymous mapping starting on a 2 MiB boundary, zero-filled by the
    kernel, advised for huge pages (``huge``) or against them. Each tensor ``take`` gives
    has a storage of its own (as torch sees it) and is no view: a compiled step that writes
    K/V into tensors that alias one storage, or into views, copies the whole tensors every
    step. The mapping lives as long as any of its tensors."""

    def __init__(self, nbytes: int, huge: bool = True) -> None:
        # whole huge pages from the aligned start, wherever the kernel put the mapping
        whole_pages = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
        self._mapping = mmap.mmap(-1, whole_pages + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        advice = getattr(mmap, "MADV_HUGEPAGE" if huge else "MADV_NOHUGEPAGE", None)
        if advice is not None:
            self._mapping.madvise(advice)
        probe = torch.frombuffer(self._mapping, dtype=torch.uint8, count=1)
        self._start = -probe.data_ptr() % HUGE_PAGE
        self.nbytes = nbytes

    def take(self, offset: int, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` at ``offset`` bytes into the arena."""
        count = torch.Size(shape).numel() * dtype.itemsize
        assert offset % _ALIGN == 0 and offset + count <= self.nbytes
        raw = torch.frombuffer(self._mapping, dtype=torch.uint8, count=count, offset=self._start + offset)
        # set_, not view: a view (``_base`` set) that a compiled step writes into gets copied back whole
        return torch.empty(0, dtype=dtype).set_(raw.untyped_storage(), 0, shape)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _arena_tensors(specs: list[tuple[torch.Size | tuple[int, ...], torch.dtype]],
                   huge: bool = True) -> list[torch.Tensor]:
    """Zero-filled tensors of these shapes and dtypes, one after another (each 64-byte
    aligned) in one new ``HugePageArena``."""
    sizes = [_aligned(torch.Size(shape).numel() * dtype.itemsize) for shape, dtype in specs]
    arena = HugePageArena(sum(sizes), huge)
    out, offset = [], 0
    for (shape, dtype), size in zip(specs, sizes, strict=True):
        out.append(arena.take(offset, shape, dtype))
        offset += size
    return out


def move_to_huge_pages(tensors: list[torch.Tensor]) -> int:
    """Move these tensors, in this order, into one huge-page mapping, each keeping its
    identity (``.data`` is swapped). Tensors that are not on the CPU, empty, not contiguous,
    or share their storage with another of them stay where they are. Returns the bytes
    moved (0 where huge pages are unavailable)."""
    if not thp_available():
        return 0
    users = Counter(t.untyped_storage().data_ptr() for t in tensors if t.numel())
    movable = [t for t in tensors if t.device.type == "cpu" and t.numel() and t.is_contiguous()
               and users[t.untyped_storage().data_ptr()] == 1]
    if not movable:
        return 0
    with torch.no_grad():
        for t, new in zip(movable, _arena_tensors([(t.shape, t.dtype) for t in movable]), strict=True):
            new.copy_(t)
            t.data = new
    return sum(_aligned(t.nbytes) for t in movable)


def move_weights(module: torch.nn.Module) -> int:
    """``move_to_huge_pages`` for ``module``'s parameters and buffers, in the order its
    modules are registered (forward order for our models), a tensor registered twice (a
    tied weight) once."""
    tensors = {id(t): t for sub in module.modules() for t in (*sub._parameters.values(), *sub._buffers.values())
               if t is not None}
    return move_to_huge_pages(list(tensors.values()))


def lazy_zeros(shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Zero-filled tensors of these shapes, on ``device``. On a CPU they lie one after
    another in one mapping of small pages that the kernel maps as they are first written
    (``torch.zeros`` would write, and so map, every page now); elsewhere ``torch.zeros``."""
    if device.type != "cpu" or not shapes or not all(torch.Size(shape).numel() for shape in shapes):
        return [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]
    return _arena_tensors([(shape, dtype) for shape in shapes], huge=False)


_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in, writable, without writing them


class PageMapper:
    """Maps the pages of block-major tensors (the K/V caches: [blocks, ...] each) before their
    first write, a chunk of blocks at a time, lowest blocks first: the order in which the block
    pool hands out blocks it has never handed out (``cache/block_pool.py``: the free list starts
    in block order, freed blocks join its end). A server calls ``map_next`` while it has no
    work, so the prefills that first write each block do not take its page faults; after that
    the pool is resident, as vLLM's is from start-up. ``madvise(MADV_POPULATE_WRITE)`` maps
    pages without writing them: it races with no K/V write. It needs Linux 5.14; elsewhere, or
    for tensors off the CPU, there is nothing to map."""

    def __init__(self, tensors: list[torch.Tensor], chunk_bytes: int = 8 << 20) -> None:
        tensors = [t for t in tensors if t.device.type == "cpu" and t.numel()]
        self._tensors = tensors
        self._madvise = _libc_madvise() if tensors else None
        self._page = mmap.PAGESIZE
        row_bytes = sum(t[0].nbytes for t in tensors)
        self._blocks_per_chunk = max(1, chunk_bytes // row_bytes) if row_bytes else 1
        self._next_block = 0
        self._num_blocks = max((t.shape[0] for t in tensors), default=0)

    @property
    def done(self) -> bool:
        return self._madvise is None or self._next_block >= self._num_blocks

    def map_next(self) -> bool:
        """Map the next chunk of blocks in every tensor; False once every page is mapped (or
        nothing can be)."""
        if self.done:
            return False
        first, end = self._next_block, min(self._next_block + self._blocks_per_chunk, self._num_blocks)
        for t in self._tensors:
            if first >= t.shape[0]:
                continue
            row = t[0].nbytes
            start = t.data_ptr() + first * row
            stop = t.data_ptr() + min(end, t.shape[0]) * row
            aligned = start - start % self._page
            if self._madvise(aligned, stop - aligned, _MADV_POPULATE_WRITE) != 0:
                log.info("the K/V pages are mapped as blocks are first written (madvise: %s)",
                         os.strerror(ctypes.get_errno()))
                self._madvise = None
                return False
        self._next_block = end
        return not self.done


def _libc_madvise():
    """libc's ``madvise`` (the GIL released while it runs), or None off Linux."""
    if sys.platform != "linux":
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise
