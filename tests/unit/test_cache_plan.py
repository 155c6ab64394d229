"""``cache.plan``: the engine's budgets into pool sizes, exactly, on plain numbers."""

from __future__ import annotations

import logging

import pytest

from hyprefix.cache.coordinator import AttentionKV
from hyprefix.cache.events import EventLog
from hyprefix.cache.plan import build_cache, checkpoint_slots, window_pool_window
from hyprefix.cache.plan import plan_pools as plan_cache_pools
from hyprefix.cache.recurrent import RecurrentStateCache
from hyprefix.cache.sliding import SlidingWindowKV
from hyprefix.config import EngineArgs
from hyprefix.engine_config import EngineConfig

MIB = 2**20


def plan_pools(args: EngineArgs, *rest, **kwargs):
    """The plan of ``args``' cache config, as the engine makes it."""
    config = EngineConfig.from_args(args)
    return plan_cache_pools(config.cache, config.scheduler.max_num_batched_tokens, *rest, **kwargs)


def cache_of(args: EngineArgs):
    return EngineConfig.from_args(args).cache


def bytes_of(all: int = 0, full: int = 0, window: int = 0):
    return {"all": all, "full": full, "window": window}.__getitem__


def test_window_pool_only_for_windows_shorter_than_the_longest_request():
    assert window_pool_window([None, None], 4096, disabled=False) is None
    assert window_pool_window([None, 512, 1024], 4096, disabled=False) == 1024
    assert window_pool_window([None, 512], 512, disabled=False) is None  # the window covers every request
    assert window_pool_window([None, 512], 4096, disabled=True) is None


def test_dense_pool_is_the_budget_over_the_block_bytes_capped():
    args = EngineArgs(kv_cache_memory_gb=1 / 1024)  # 1 MiB
    plan = plan_pools(args, [None, None], 2048, bytes_of(all=4096), state_bytes=0)
    assert (plan.num_blocks, plan.num_window_blocks, plan.window, plan.num_checkpoints) == (256, 0, None, 0)
    assert plan.bytes_per_block == 4096
    capped = plan_pools(EngineArgs(kv_cache_memory_gb=1.0, max_kv_blocks=100), [None], 2048, bytes_of(all=4096), 0)
    assert capped.num_blocks == 100
    given = plan_pools(EngineArgs(num_kv_blocks=7), [None], 2048, bytes_of(all=4096), 0)
    assert given.num_blocks == 7


def test_window_pool_takes_its_ratio_and_at_least_one_request():
    args = EngineArgs(kv_cache_memory_gb=1 / 1024, swa_full_tokens_ratio=0.5, block_size=16,
                      max_num_batched_tokens=64)
    plan = plan_pools(args, [None, 100], 4096, bytes_of(full=1000, window=2000), state_bytes=0)
    # 1 MiB over (1000 + 0.5 * 2000) bytes per main block
    assert plan.num_blocks == MIB // 2000 and plan.window == 100
    assert plan.num_window_blocks == -(-plan.num_blocks * 1 // 2)
    tiny = plan_pools(EngineArgs(num_kv_blocks=2, swa_full_tokens_ratio=0.5, block_size=16, max_num_batched_tokens=64),
                      [None, 100], 4096, bytes_of(full=1000, window=2000), 0)
    # at least ceil(99 / 16) + 2 + ceil(64 / 16) blocks: one request's window and chunk
    assert tiny.num_window_blocks == 7 + 2 + 4


def test_only_sliding_layers_give_the_window_pool_the_budget():
    args = EngineArgs(kv_cache_memory_gb=1 / 1024, max_kv_blocks=50)
    plan = plan_pools(args, [100, 100], 4096, bytes_of(full=0, window=1024), 0)
    assert (plan.num_blocks, plan.num_window_blocks) == (50, 1024)


def test_a_budget_below_one_block_is_refused():
    with pytest.raises(ValueError, match="too small for one KV block"):
        plan_pools(EngineArgs(kv_cache_memory_gb=1e-9), [None], 2048, bytes_of(all=4096), 0)


def test_checkpoint_slots(caplog):
    args = EngineArgs(state_cache_memory_gb=1 / 1024, max_state_checkpoints=1000)
    assert checkpoint_slots(cache_of(args), 4096) == 256
    assert checkpoint_slots(cache_of(EngineArgs(state_cache_memory_gb=1.0, max_state_checkpoints=9)), 4096) == 9
    assert checkpoint_slots(cache_of(EngineArgs(enable_prefix_caching=False)), 4096) == 0
    assert checkpoint_slots(cache_of(EngineArgs(state_cache_memory_gb=0.0)), 4096) == 0
    with caplog.at_level(logging.WARNING, logger="hyprefix"):
        assert checkpoint_slots(cache_of(EngineArgs(state_cache_memory_gb=1e-9)), 4096) == 0
    assert "hybrid prefix hits are disabled" in caplog.text
    plan = plan_pools(args, [None], 2048, bytes_of(all=4096), state_bytes=4096)
    assert plan.num_checkpoints == 256


def test_build_cache_wires_the_kinds_the_model_has():
    events = EventLog(enabled=False)
    dense = build_cache(8, 16, True, "m", events, max_seqs=4)
    assert [type(k) for k in dense.kinds] == [AttentionKV]
    hybrid = build_cache(8, 16, True, "m", events, max_seqs=4, window=32, window_blocks=6, checkpoints=3)
    assert [type(k) for k in hybrid.kinds] == [AttentionKV, SlidingWindowKV, RecurrentStateCache]
    recurrent = build_cache(8, 16, True, "m", events, max_seqs=4, attention=False, checkpoints=3)
    assert [type(k) for k in recurrent.kinds] == [RecurrentStateCache]
    assert len(dense.kv.pool.blocks) == 8 and dense.kv.model_identity == "m"
