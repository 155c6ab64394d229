"""From the engine's memory budget to its cache: how many blocks each pool gets
(``plan_pools``) and the ``CacheCoordinator`` the scheduler drives (``build_cache``).

Plain numbers in, plain objects out (no torch): the engine asks the model for its bytes
per block and per state, the tests wire a scheduler with the same ``build_cache``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hyprefix.cache.checkpoint_policy import CheckpointPolicy
from hyprefix.cache.coordinator import AttentionKV, CacheCoordinator, CacheKind
from hyprefix.cache.events import EventLog
from hyprefix.cache.kv import KVCacheManager
from hyprefix.cache.kv_eviction import KVEvictionPolicy
from hyprefix.cache.recurrent import RecurrentStateCache
from hyprefix.cache.sliding import SlidingWindowKV
from hyprefix.cache.state_pool import StatePool

if TYPE_CHECKING:
    from hyprefix.engine_config import CacheConfig

log = logging.getLogger("hyprefix")

GIB = 2**30


@dataclass(frozen=True)
class PoolPlan:
    num_blocks: int  # main pool (full-attention layers, or every attention layer without a window pool)
    num_window_blocks: int  # sliding-window layers' own pool (0: none)
    bytes_per_block: int
    bytes_per_window_block: int
    window: int | None  # the window of the window pool (None: no window pool)
    num_checkpoints: int  # recurrent-state checkpoint slots (0: no hybrid prefix hits)


def window_pool_window(windows: Sequence[int | None], max_model_len: int, disabled: bool) -> int | None:
    """The widest sliding window when the sliding layers get a pool of their own (some
    layer has a window shorter than the longest request), else None. ``windows``: each
    attention layer's window (None: full attention)."""
    sliding = [w for w in windows if w is not None]
    if not sliding or disabled or max(sliding) >= max_model_len:
        return None
    return max(sliding)


def plan_pools(config: CacheConfig, max_num_batched_tokens: int, windows: Sequence[int | None], max_model_len: int,
               kv_bytes_per_block: Callable[[str], int], state_bytes: int) -> PoolPlan:
    """The pools ``config``'s budgets pay for (a window pool holds a chunk of
    ``max_num_batched_tokens`` at least). ``kv_bytes_per_block(which)``: the bytes of one
    block of the layers ``which`` is ("all", "full" or "window") names; ``state_bytes``: one
    recurrent-state slot (0: no recurrent layers).

    The window pool holds ``swa_full_tokens_ratio`` tokens per main-pool token, and at least
    what one request needs to make progress (its window and a chunk); without full-attention
    layers the main blocks only index the cache and the window pool takes the budget."""
    args = config
    window = window_pool_window(windows, max_model_len, args.disable_hybrid_swa_memory)
    window_pool = window is not None
    per_block = kv_bytes_per_block("full" if window_pool else "all")
    per_window = kv_bytes_per_block("window") if window_pool else 0
    ratio = args.swa_full_tokens_ratio if window_pool else 0.0
    budget = int(args.kv_cache_memory_gb * GIB)
    if args.num_kv_blocks is not None:
        num_blocks = args.num_kv_blocks
    elif per_block == 0:
        num_blocks = args.max_kv_blocks
    else:
        num_blocks = min(int(budget // (per_block + ratio * per_window)), args.max_kv_blocks)
    num_window = 0
    if window is not None:
        bs = args.block_size
        least = -(-(window - 1) // bs) + 2 + -(-max_num_batched_tokens // bs)
        if per_block == 0 and args.num_kv_blocks is None:
            num_window = budget // per_window
        else:
            num_window = max(math.ceil(num_blocks * ratio), least)
    if num_blocks < 1 or (window_pool and num_window < 1):
        raise ValueError(f"kv_cache_memory_gb={args.kv_cache_memory_gb} is too small for one KV block "
                         f"({per_block + per_window} bytes)")
    return PoolPlan(num_blocks, num_window, per_block, per_window, window,
                    checkpoint_slots(args, state_bytes) if state_bytes else 0)


def checkpoint_slots(args: CacheConfig, state_bytes: int) -> int:
    """Recurrent-state checkpoint slots the budget pays for (0 disables hybrid hits)."""
    if not args.enable_prefix_caching or args.state_cache_memory_gb <= 0:
        return 0
    slots = min(int(args.state_cache_memory_gb * GIB) // state_bytes, args.max_state_checkpoints)
    if slots == 0:
        log.warning("state_cache_memory_gb=%s is smaller than one state checkpoint (%.2f MiB): no "
                    "checkpoints, so hybrid prefix hits are disabled", args.state_cache_memory_gb,
                    state_bytes / 2**20)
    return slots


def build_cache(num_blocks: int, block_size: int, caching: bool, model_identity: str, events: EventLog | None,
                max_seqs: int, attention: bool = True, window: int | None = None, window_blocks: int = 0,
                checkpoints: int | None = None, checkpoint_policy: CheckpointPolicy | None = None,
                kv_eviction: KVEvictionPolicy | None = None) -> CacheCoordinator:
    """The cache of a model with full-attention layers (``attention``), sliding-window
    layers with a pool of ``window_blocks`` of their own (``window``) and recurrent layers
    with ``checkpoints`` checkpoint slots (None: no recurrent layers) that ``checkpoint_policy``
    evicts (None: LRU), as the engine wires it. ``kv_eviction`` picks the main pool's victims
    (None: LRU); the window pool's stay LRU (its blocks leave as the window moves)."""
    kinds: list[CacheKind] = [AttentionKV()] if attention else []
    if window is not None:
        kinds.append(SlidingWindowKV(window_blocks, block_size, window, caching))
    if checkpoints is not None:
        kinds.append(RecurrentStateCache(StatePool(max_seqs, checkpoints, events, checkpoint_policy), block_size))
    kv = KVCacheManager(num_blocks, block_size, caching, model_identity, events, kv_eviction)
    return CacheCoordinator(kv, kinds)
