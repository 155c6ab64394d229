"""The engine's typed configuration: ``EngineArgs`` (the flat, user-facing flags) split once
into the parts each piece of the engine reads, as vLLM's ``VllmConfig``.

``EngineConfig.from_args`` is the one place the flat arguments are read; past it every part
of the engine takes its own sub-config (the cache plan a ``CacheConfig``, the runner a
``RunnerConfig``, the scheduler a ``SchedulerConfig``) and no JSON text remains: the
``--speculative-config`` and ``--kv-events-config`` objects are parsed and validated by
``EngineArgs`` itself, once. The cache plan (``cache/plan.py``, no torch) reads ``CacheConfig``
by its fields only.
"""

from __future__ import annotations

from dataclasses import dataclass

from hyprefix.cache.retention import RetentionConfig
from hyprefix.catalog import DEFAULT_MODEL, default_quantization
from hyprefix.config import EngineArgs
from hyprefix.kv_events import KVEventsConfig
from hyprefix.scheduler import SchedulerConfig
from hyprefix.speculative import SpeculativeConfig


@dataclass(frozen=True)
class ModelConfig:
    """What to load, and how its weights are kept."""

    model: str  # path, hub id or catalog name (``catalog.DEFAULT_MODEL`` when none was given)
    tokenizer: str | None  # None: the model's
    revision: str | None
    dtype: str  # one of ``config.DTYPES``
    quantization: str | None  # after the catalog's default for this model
    max_model_len: int | None  # None: the model's max_position_embeddings
    lm_head_fp32: bool
    weight_version: str  # name of the weights loaded at start (part of every block hash)


@dataclass(frozen=True)
class DiskCacheConfig:
    """The disk tier (``disk/``): where, how large, and whether every block is written when computed."""

    directory: str
    capacity_gb: float
    write_through: bool


@dataclass(frozen=True)
class CacheConfig:
    """Budgets and shape of the memory pools (``cache/plan.py``) and the disk tier under them."""

    block_size: int
    enable_prefix_caching: bool
    kv_cache_memory_gb: float
    num_kv_blocks: int | None  # overrides kv_cache_memory_gb
    max_kv_blocks: int
    state_cache_memory_gb: float
    max_state_checkpoints: int
    state_dtype: str  # "float32" or "bfloat16": the recurrent matrix states, live and checkpointed
    swa_full_tokens_ratio: float
    disable_hybrid_swa_memory: bool
    disk: DiskCacheConfig | None
    kv_cache_dtype: str = "auto"  # one of ``config.KV_CACHE_DTYPES`` (models/kv_quant.py)
    state_eviction_policy: str = "lru"  # one of ``config.STATE_EVICTION_POLICIES`` (cache/checkpoint_policy.py)
    kv_eviction_policy: str = "lru"  # one of ``config.KV_EVICTION_POLICIES`` (cache/kv_eviction.py)


@dataclass(frozen=True)
class RunnerConfig:
    """How steps execute on the device (``runner/model_runner.py``). The engine runs on one
    device; replicas (the server's ``--replicas``) are whole engines, so there is no
    parallel config of its own here."""

    device: str
    compile: bool  # torch.compile'd kernels of large steps and decode graphs (not --enforce-eager)
    batch_invariant: bool
    seed: int
    logprobs_mode: str  # one of ``config.LOGPROBS_MODES``
    cascade_min_saved_tokens: int
    cascade_min_solo_run_tokens: int
    cascade_min_traffic_ratio: float


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig  # limits only: the engine adds what the loaded model decides
    runner: RunnerConfig
    speculative: SpeculativeConfig | None
    events: KVEventsConfig | None  # None: KV cache events off
    max_logprobs: int
    log_stats_interval: float

    @classmethod
    def from_args(cls, args: EngineArgs) -> EngineConfig:
        """Every sub-config from ``args`` (validated already by ``EngineArgs``)."""
        model = args.model or DEFAULT_MODEL
        events = args.kv_events_config
        assert events is None or isinstance(events, KVEventsConfig), "EngineArgs parses it"
        assert args.speculative_config is None or isinstance(args.speculative_config, SpeculativeConfig)
        disk = DiskCacheConfig(args.disk_cache_dir, args.disk_cache_gb, args.disk_cache_write_through) \
            if args.disk_cache_dir else None
        return cls(
            model=ModelConfig(model, args.tokenizer, args.revision, args.dtype,
                              args.quantization or default_quantization(model), args.max_model_len,
                              args.lm_head_fp32, args.weight_version),
            cache=CacheConfig(args.block_size, args.enable_prefix_caching, args.kv_cache_memory_gb,
                              args.num_kv_blocks, args.max_kv_blocks, args.state_cache_memory_gb,
                              args.max_state_checkpoints,
                              "bfloat16" if args.mamba_ssm_cache_dtype == "bfloat16" else "float32",
                              args.swa_full_tokens_ratio, args.disable_hybrid_swa_memory, disk, args.kv_cache_dtype,
                              args.state_cache_eviction_policy, args.kv_cache_eviction_policy),
            scheduler=SchedulerConfig(args.max_num_batched_tokens, args.max_num_seqs,
                                      speculative=args.speculative_config, policy=args.scheduling_policy,
                                      max_wait_s=args.scheduling_max_wait_s,
                                      highest_priority=args.highest_request_priority,
                                      retention=RetentionConfig(args.max_retention_s, args.retention_budget_fraction,
                                                                args.retention_tenant_fraction)),
            runner=RunnerConfig(args.device, not args.enforce_eager, args.batch_invariant, args.seed,
                                args.logprobs_mode, args.cascade_min_saved_tokens, args.cascade_min_solo_run_tokens,
                                args.cascade_min_traffic_ratio),
            speculative=args.speculative_config,
            events=events if events is not None and events.enabled else None,
            max_logprobs=args.max_logprobs,
            log_stats_interval=args.log_stats_interval,
        )
