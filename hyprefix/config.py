"""Engine arguments: built and validated once, never mutated afterwards."""

from __future__ import annotations

from dataclasses import dataclass, fields

DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("int8",)


@dataclass(frozen=True)
class EngineArgs:
    """Everything ``LLM(...)`` and ``hyprefix serve`` accept.

    ``model`` None means the built-in (hybrid NemotronH-style) demo model. ``num_kv_blocks`` overrides the
    pool size derived from ``kv_cache_memory_gb``. ``max_model_len`` None means
    the model's ``max_position_embeddings``. ``enforce_eager`` turns off
    ``torch.compile``: the elementwise kernels of large steps and the compiled decode
    steps (``runner/decode_graph.py``).
    """

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "cpu"
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None
    kv_cache_memory_gb: float = 2.0
    num_kv_blocks: int | None = None
    max_kv_blocks: int = 1 << 16
    mamba_cache_memory_gb: float = 1.0
    max_mamba_checkpoints: int = 4096
    # Sliding-window attention layers (Gemma 3, Mistral) keep their K/V in a pool of
    # their own holding this many tokens per token of the full-attention pool; a
    # running request gives back the blocks that left its window. With
    # disable_hybrid_swa_memory they share the main pool and keep every block.
    swa_full_tokens_ratio: float = 0.8
    disable_hybrid_swa_memory: bool = False
    seed: int = 0
    # Quantization of the linear layers and LM head: None or "int8" (int8 weights: a GGUF's Q8_0
    # blocks as they are, per-channel scales for float weights; activations quantized per 32
    # at run time: models/quant.py).
    quantization: str | None = None
    enforce_eager: bool = False
    # Decode attention reads a shared prefix once for its group when that saves at least
    # this many K/V rows, and a row's private blocks in place when they hold at least
    # this many tokens (runner/cascade.py).
    cascade_min_saved_tokens: int = 256
    cascade_min_solo_run_tokens: int = 256
    # Where decode steps have a fast path (the int8 decode kernel, a compiled decode graph),
    # which reads every row's K/V whole, a shared prefix is read once (on the eager path) only
    # when reading every row whole would move at least this many times the bytes (weights +
    # K/V) of the shared plan; 0 always shares (runner/cascade.py, FastPathCost).
    cascade_min_traffic_ratio: float = 4.0
    log_stats_interval: float = 5.0
    revision: str | None = None
    # KV cache events over ZMQ (kv_events.py), vLLM's flag: a JSON object such as
    # '{"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'; None: off.
    kv_events_config: str | None = None

    def __post_init__(self) -> None:
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {self.quantization!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "max_kv_blocks",
                     "max_mamba_checkpoints"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("cascade_min_saved_tokens", "cascade_min_solo_run_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        for name in ("max_model_len", "num_kv_blocks"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        for name in ("kv_cache_memory_gb", "mamba_cache_memory_gb", "cascade_min_traffic_ratio"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not self.swa_full_tokens_ratio > 0:
            raise ValueError(f"swa_full_tokens_ratio must be > 0, got {self.swa_full_tokens_ratio!r}")
        if self.kv_events_config is not None:
            from hyprefix.kv_events import KVEventsConfig

            KVEventsConfig.parse(self.kv_events_config)
        if self.num_kv_blocks is None and self.kv_cache_memory_gb <= 0:
            raise ValueError("kv_cache_memory_gb must be > 0 when num_kv_blocks is not given")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
