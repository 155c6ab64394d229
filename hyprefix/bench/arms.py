"""Timed runs of one prompt set on each engine ("arm"): hyprefix and plain transformers.

Both arms expose the same two measurements, and time them the same way:

``prefill(ids)``
    Wall time of one call that turns a single prompt into exactly one new token
    (hyprefix: ``LLM.generate`` with ``max_tokens=1`` and a token budget that fits the
    whole prompt in one step; transformers: ``model.generate(max_new_tokens=1,
    do_sample=False)``). Prefill throughput is ``len(ids) / seconds``; the call's own
    overhead (validation, generation-config set-up) is part of what is measured.

``decode(prompts, new_tokens)``
    The B prompts decode together, greedily, exactly ``new_tokens`` tokens each. A
    timestamp (``time.perf_counter``) is taken each time a new token is available on the
    host for every sequence: hyprefix: after each ``Engine.step()`` returns (we step the
    engine ourselves); transformers: inside a ``StoppingCriteria``, which ``generate``
    calls once per step right after the step's tokens are selected and appended. The
    prefill is excluded: decode time runs from the first moment *all* B sequences have
    their first token to the moment the last token is out, and the tokens counted are
    exactly the ones produced in that window (``B × (new_tokens - 1)`` when the prompts
    are prefilled in one step, which the hyprefix arm's token budget ensures).
    Transformers gets equal-length prompts, so its batch needs no padding; unequal
    prompts are left-padded with ``pad_token_id=0`` and an attention mask.

Only one arm runs at a time; both stay loaded for the whole benchmark.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Protocol

import torch
from transformers import StoppingCriteria, StoppingCriteriaList


@dataclass
class PrefillTiming:
    prompt_len: int
    seconds: float
    first_token: int
    ttft_seconds: float | None = None  # engine-reported arrival -> first token (hyprefix only)
    cached_tokens: int = 0
    other_cores_avg: float | None = None  # CPU other processes used meanwhile (set by the workload)

    @property
    def tokens_per_s(self) -> float:
        return self.prompt_len / self.seconds

    def to_dict(self) -> dict:
        return {**asdict(self), "tokens_per_s": self.tokens_per_s}


@dataclass
class DecodeTiming:
    batch: int
    prompt_len: int
    new_tokens: int
    total_seconds: float  # call start -> last token
    prefill_seconds: float  # call start -> every sequence has its first token
    decode_seconds: float  # every sequence has its first token -> last token
    decode_tokens: int  # tokens produced within decode_seconds, summed over the batch
    steps: int
    token_ids: list[list[int]] = field(repr=False, default_factory=list)
    other_cores_avg: float | None = None  # CPU other processes used meanwhile (set by the workload)

    @property
    def tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else float("nan")

    def to_dict(self) -> dict:
        d = asdict(self)
        del d["token_ids"]
        return {**d, "tokens_per_s": self.tokens_per_s}


class Arm(Protocol):
    name: str

    def info(self) -> dict: ...

    def prefill(self, ids: list[int]) -> PrefillTiming: ...

    def decode(self, prompts: list[list[int]], new_tokens: int) -> DecodeTiming: ...


def run_dtype(model: str, dtype: str) -> str:
    """``dtype`` with "auto" resolved as the engine resolves it on this CPU
    (``hardware.DeviceCaps.auto_dtype`` of the checkpoint's dtype)."""
    if dtype != "auto":
        return dtype
    from transformers import AutoConfig

    from hyprefix.hardware import DTYPE_NAMES, device_caps
    from hyprefix.models.loader import checkpoint_dtype

    chosen, _ = device_caps("cpu").auto_dtype(checkpoint_dtype(AutoConfig.from_pretrained(model)))
    return DTYPE_NAMES[chosen]


class HyprefixArm:
    def __init__(self, model: str, dtype: str, *, max_prompt_tokens: int, max_batch: int,
                 max_kv_tokens: int, seed: int = 0, block_size: int = 16, name: str = "hyprefix") -> None:
        from hyprefix import LLM

        self.name = name
        # Pool for the biggest live set of tokens, with head-room; a bigger pool costs
        # memory, not speed.
        kv_bytes = self._kv_bytes_per_token(model, run_dtype(model, dtype))
        self._kv_gb = max(2.0, 1.5 * max_kv_tokens * kv_bytes / 2**30)
        self._max_batched = max(2048, max_prompt_tokens)
        self.llm = LLM(model=model, dtype=dtype, block_size=block_size, max_num_batched_tokens=self._max_batched,
                       max_num_seqs=max(64, max_batch), kv_cache_memory_gb=self._kv_gb,
                       enable_prefix_caching=True, seed=seed, log_stats_interval=0)
        self._ids = 0

    @staticmethod
    def _kv_bytes_per_token(model: str, dtype: str) -> int:
        from hyprefix.bench.flops import ModelShape

        shape = ModelShape.from_config(model)
        elem = 4 if dtype == "float32" else 2
        return 2 * shape.layers * shape.kv_heads * shape.head_dim * elem

    def info(self) -> dict:
        import hyprefix

        return {"version": hyprefix.__version__, "max_num_batched_tokens": self._max_batched,
                "kv_cache_memory_gb": round(self._kv_gb, 3), "enable_prefix_caching": True,
                "kv_blocks": self.llm.get_stats()["kv_blocks_total"],
                "dtype": str(self.llm.engine.dtype).replace("torch.", "")}

    def prefill(self, ids: list[int]) -> PrefillTiming:
        from hyprefix import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        t0 = time.perf_counter()
        out = self.llm.generate([list(ids)], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - t0
        m = out.metrics
        ttft = None if m.first_token_time is None else m.first_token_time - m.arrival_time
        return PrefillTiming(prompt_len=len(ids), seconds=seconds, first_token=out.outputs[0].token_ids[0],
                             ttft_seconds=ttft, cached_tokens=out.num_cached_tokens)

    def decode(self, prompts: list[list[int]], new_tokens: int) -> DecodeTiming:
        from hyprefix import SamplingParams

        engine = self.llm.engine
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        ids = []
        for _ in prompts:
            ids.append(f"bench-{self._ids}")
            self._ids += 1
        counts = dict.fromkeys(ids, 0)
        tokens: dict[str, list[int]] = {}
        done: set[str] = set()
        t_first: float | None = None
        counts_at_first: dict[str, int] = {}
        steps = 0
        t0 = time.perf_counter()
        for request_id, prompt in zip(ids, prompts, strict=True):
            engine.add_request(request_id, list(prompt), params)
        now = t0
        while len(done) < len(ids):
            outputs = engine.step()
            now = time.perf_counter()
            steps += 1
            if not outputs and not engine.has_unfinished():
                raise RuntimeError(f"engine went idle with {len(ids) - len(done)} benchmark requests unfinished")
            for out in outputs:
                if out.request_id not in counts:
                    continue
                counts[out.request_id] = len(out.outputs[0].token_ids)
                if out.finished:
                    done.add(out.request_id)
                    tokens[out.request_id] = list(out.outputs[0].token_ids)
            if t_first is None and all(c >= 1 for c in counts.values()):
                t_first, counts_at_first = now, dict(counts)
        assert t_first is not None
        got = [len(tokens[i]) for i in ids]
        if any(n != new_tokens for n in got):
            raise RuntimeError(f"hyprefix produced {got} tokens, expected {new_tokens} each")
        return DecodeTiming(
            batch=len(prompts), prompt_len=len(prompts[0]), new_tokens=new_tokens, total_seconds=now - t0,
            prefill_seconds=t_first - t0, decode_seconds=now - t_first,
            decode_tokens=sum(new_tokens - counts_at_first[i] for i in ids), steps=steps,
            token_ids=[tokens[i] for i in ids])


class _StepClock(StoppingCriteria):
    """A stopping criterion that never stops, and notes when each step's tokens are out."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        self.stamps.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class TransformersArm:
    def __init__(self, model: str, dtype: str, name: str = "transformers") -> None:
        from transformers import AutoModelForCausalLM

        self.name = name
        from hyprefix.hardware import DTYPES

        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=DTYPES[dtype])
        self.model.eval()

    def info(self) -> dict:
        import transformers

        return {"version": transformers.__version__, "class": type(self.model).__name__,
                "attn_implementation": getattr(self.model.config, "_attn_implementation", None),
                "dtype": str(self.model.dtype).replace("torch.", "")}

    @staticmethod
    def _batch(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for row, p in enumerate(prompts):  # left padding with pad id 0
            ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[row, width - len(p):] = 1
        return ids, mask

    def prefill(self, ids: list[int]) -> PrefillTiming:
        input_ids, mask = self._batch([list(ids)])
        t0 = time.perf_counter()
        out = self.model.generate(input_ids, attention_mask=mask, max_new_tokens=1, do_sample=False,
                                  pad_token_id=0)
        seconds = time.perf_counter() - t0
        return PrefillTiming(prompt_len=len(ids), seconds=seconds, first_token=int(out[0, input_ids.shape[1]]))

    def decode(self, prompts: list[list[int]], new_tokens: int) -> DecodeTiming:
        input_ids, mask = self._batch(prompts)
        clock = _StepClock()
        t0 = time.perf_counter()
        out = self.model.generate(input_ids, attention_mask=mask, max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                                  stopping_criteria=StoppingCriteriaList([clock]))
        t_end = time.perf_counter()
        produced = out.shape[1] - input_ids.shape[1]
        if produced != new_tokens or len(clock.stamps) != new_tokens:
            raise RuntimeError(f"transformers produced {produced} tokens in {len(clock.stamps)} steps, "
                               f"expected {new_tokens}")
        return DecodeTiming(
            batch=len(prompts), prompt_len=input_ids.shape[1], new_tokens=new_tokens, total_seconds=t_end - t0,
            prefill_seconds=clock.stamps[0] - t0, decode_seconds=clock.stamps[-1] - clock.stamps[0],
            decode_tokens=len(prompts) * (new_tokens - 1), steps=new_tokens,
            token_ids=out[:, input_ids.shape[1]:].tolist())
