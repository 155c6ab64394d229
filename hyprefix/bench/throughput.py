"""The ``throughput`` workload: prefill and decode tokens/s, hyprefix vs plain transformers.

Cases, each measured ``repeats`` times with fresh random prompts (token ids below 4096,
seeded; every arm gets the same prompts in a repeat, and no prompt is ever reused, so a
prefix cache cannot turn a measurement into a cache hit):

* ``prefill``: one ``prompt_len``-token prompt, one new token; ``prompt_len / seconds``
  of the whole call (see ``hyprefix.bench.arms`` for how each arm is called).
* ``decode@B`` for each batch size B: B prompts of ``decode_prompt_len`` tokens,
  ``decode_tokens`` greedy new tokens each (EOS ignored); throughput is the tokens
  produced after every sequence has its first token, divided by the time from that
  moment to the last token, so the prefill is excluded. Transformers runs the same B
  (batched ``generate``) for comparison.

Arms run one at a time, interleaved: each arm is warmed up once on every case first,
then for every repeat and case the arms run back to back in ``--arms`` order, so slow
phases of a noisy machine hit them alike. Each number reported is the median over
repeats (the min-max range is reported too). Every timed run also records how much CPU
other processes used meanwhile (``hyprefix.bench.env.CpuMeter``): on a machine shared
with other work, a run with ``torch.set_num_threads(cores)`` can slow down several-fold
when any core is taken, so disturbed runs are counted and flagged. An arm name may carry a dtype,
``hyprefix@float32`` or ``transformers@bfloat16``, to compare dtypes in one run; a bare
name runs at ``--dtype`` (``auto``: the engine's choice for this CPU; the transformers
arm gets the same resolved dtype). The ratios the issue targets are computed from the
medians, with the target set of the CPU kind (``hardware.DeviceCaps.native_bf16``):

* native bf16 (AVX512-BF16 / AMX): prefill hyprefix / transformers >= 1.3, decode
  hyprefix batch 16 / transformers batch 1 >= 4, batch 1 / batch 1 >= 1.2;
* no native bf16 (AVX2; float32 is the fast path): prefill >= 1.1, batch 16 /
  transformers batch 1 >= 5, batch 16 / transformers batch 16 >= 1.5, batch 1 >= 1.3;
* with ``hyprefix@DTYPE`` arms: prefill hyprefix / the fastest of them >= 0.9 (``auto``
  within 10 % of the faster explicit dtype);

plus hyprefix's prefill FLOP rate as a fraction of the measured matmul peak
(``hyprefix.bench.flops`` for the FLOP count, ``hyprefix.bench.peak`` for the peak).
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hyprefix.bench.arms import Arm, DecodeTiming, HyprefixArm, PrefillTiming, TransformersArm
from hyprefix.bench.env import CpuMeter
from hyprefix.bench.flops import ModelShape, prefill_flops
from hyprefix.bench.peak import PeakResult
from hyprefix.config import DTYPES

PROMPT_TOKEN_LIMIT = 4096  # random prompt ids are drawn from [0, 4096)
ARMS = ("hyprefix", "transformers")
ARM_DTYPES = DTYPES  # the engine's dtype names, "auto" included
# A timed run is "disturbed" when other processes used more than this many cores meanwhile.
DISTURBED_CORES = 0.25
# (name, numerator (arm, case), denominator (arm, case), target), per CPU kind
Target = tuple[str, tuple[str, str], tuple[str, str], float]
TARGETS: dict[str, list[Target]] = {
    "native-bf16": [
        ("prefill hyprefix / transformers", ("hyprefix", "prefill"), ("transformers", "prefill"), 1.3),
        ("decode hyprefix B=16 / transformers B=1", ("hyprefix", "decode@16"), ("transformers", "decode@1"), 4.0),
        ("decode hyprefix B=1 / transformers B=1", ("hyprefix", "decode@1"), ("transformers", "decode@1"), 1.2),
    ],
    "no-native-bf16": [
        ("prefill hyprefix / transformers", ("hyprefix", "prefill"), ("transformers", "prefill"), 1.1),
        ("decode hyprefix B=16 / transformers B=1", ("hyprefix", "decode@16"), ("transformers", "decode@1"), 5.0),
        ("decode hyprefix B=16 / transformers B=16", ("hyprefix", "decode@16"), ("transformers", "decode@16"),
         1.5),
        ("decode hyprefix B=1 / transformers B=1", ("hyprefix", "decode@1"), ("transformers", "decode@1"), 1.3),
    ],
}
AUTO_PREFILL_TARGET = 0.9  # hyprefix at --dtype vs the fastest hyprefix@DTYPE arm


def split_arm(name: str) -> tuple[str, str | None]:
    """``"hyprefix@float32"`` -> ("hyprefix", "float32"); a bare name has no dtype of its own."""
    base, sep, dtype = name.partition("@")
    return base, (dtype if sep else None)


Progress = Callable[[str], None]


@dataclass(frozen=True)
class ThroughputConfig:
    prompt_len: int = 1024
    decode_prompt_len: int = 128
    decode_tokens: int = 64
    batch_sizes: tuple[int, ...] = (1, 16)
    repeats: int = 3
    seed: int = 0
    arms: tuple[str, ...] = ARMS
    warmup_decode_tokens: int = 4

    def __post_init__(self) -> None:
        for name in ("prompt_len", "decode_prompt_len", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.decode_tokens < 2:
            raise ValueError(f"decode_tokens must be >= 2 (the first token comes from the prefill), "
                             f"got {self.decode_tokens}")
        if not self.batch_sizes or any(b < 1 for b in self.batch_sizes):
            raise ValueError(f"batch sizes must be >= 1, got {list(self.batch_sizes)}")
        unknown = [a for a in self.arms if split_arm(a)[0] not in ARMS or split_arm(a)[1] not in (None, *ARM_DTYPES)]
        if unknown or not self.arms or len(set(self.arms)) != len(self.arms):
            raise ValueError(f"arms must be distinct names from {', '.join(ARMS)}, each optionally with @DTYPE "
                             f"({', '.join(ARM_DTYPES)}), got {','.join(self.arms)}")

    @property
    def cases(self) -> list[str]:
        return ["prefill", *[f"decode@{b}" for b in self.batch_sizes]]

    def num_runs(self) -> int:
        """Timed and warm-up runs, for a progress bar."""
        return len(self.arms) * len(self.cases) * (self.repeats + 1)


def _prompts(seed: int, repeat: int, case: str, count: int, length: int) -> list[list[int]]:
    rng = random.Random(f"throughput/{seed}/{repeat}/{case}")
    return [[rng.randrange(PROMPT_TOKEN_LIMIT) for _ in range(length)] for _ in range(count)]


def load_arm(name: str, model: str, dtype: str, cfg: ThroughputConfig) -> Arm:
    """``dtype``: the run's ``--dtype``, used unless the name carries its own (``hyprefix@float32``)."""
    from hyprefix.bench.arms import run_dtype

    base, own = split_arm(name)
    dtype = own or dtype
    if base == "hyprefix":
        biggest = max(cfg.batch_sizes)
        # One step holds the whole prefill prompt, or all decode prompts of a batch.
        step_tokens = max(cfg.prompt_len, biggest * cfg.decode_prompt_len)
        kv_tokens = max(biggest * (cfg.decode_prompt_len + cfg.decode_tokens), cfg.prompt_len + 1)
        return HyprefixArm(model, dtype, max_prompt_tokens=step_tokens, max_batch=biggest, max_kv_tokens=kv_tokens,
                           seed=cfg.seed, name=name)
    if base == "transformers":
        return TransformersArm(model, run_dtype(model, dtype), name=name)
    raise ValueError(f"unknown arm {name!r}")


def _run_case(arm: Arm, cfg: ThroughputConfig, case: str, repeat: int,
              decode_tokens: int) -> PrefillTiming | DecodeTiming:
    if case == "prefill":
        (ids,) = _prompts(cfg.seed, repeat, case, 1, cfg.prompt_len)
        return arm.prefill(ids)
    batch = int(case.split("@")[1])
    return arm.decode(_prompts(cfg.seed, repeat, case, batch, cfg.decode_prompt_len), decode_tokens)


def run_throughput(arms: dict[str, Arm], model: str, cfg: ThroughputConfig, peak: PeakResult | None,
                   progress: Progress = lambda _: None, cpu_kind: str = "native-bf16") -> dict[str, Any]:
    """Warm up, run the interleaved repeats and summarise; ``arms`` are already loaded."""
    for name, arm in arms.items():
        for case in cfg.cases:
            progress(f"warm-up {name} {case}")
            _run_case(arm, cfg, case, repeat=-1, decode_tokens=cfg.warmup_decode_tokens)

    runs: dict[str, dict[str, list[PrefillTiming | DecodeTiming]]] = {n: {c: [] for c in cfg.cases} for n in arms}
    for repeat in range(cfg.repeats):
        for case in cfg.cases:
            for name, arm in arms.items():
                progress(f"repeat {repeat + 1}/{cfg.repeats} {name} {case}")
                meter = CpuMeter()
                meter.start()
                timing = _run_case(arm, cfg, case, repeat, cfg.decode_tokens)
                timing.other_cores_avg = meter.stop()["other_cores_avg"]
                runs[name][case].append(timing)
    return summarise(runs, model, cfg, peak, cpu_kind)


def summarise(runs: dict[str, dict[str, list[PrefillTiming | DecodeTiming]]], model: str, cfg: ThroughputConfig,
              peak: PeakResult | None, cpu_kind: str = "native-bf16") -> dict[str, Any]:
    """``cpu_kind`` picks the target set (a key of ``TARGETS``)."""
    shape = ModelShape.from_config(model)
    flops = prefill_flops(shape, cfg.prompt_len)
    medians = {name: {case: statistics.median(t.tokens_per_s for t in timings) for case, timings in cases.items()}
               for name, cases in runs.items()}
    ranges = {name: {case: [min(t.tokens_per_s for t in timings), max(t.tokens_per_s for t in timings)]
                     for case, timings in cases.items()} for name, cases in runs.items()}
    contention = [t.other_cores_avg for cases in runs.values() for timings in cases.values() for t in timings]
    disturbed = sum(c is not None and c > DISTURBED_CORES for c in contention)

    ratios = []

    def ratio(label: str, num: tuple[str, str], den: tuple[str, str], target: float | None) -> None:
        value = None
        if num[0] in medians and den[0] in medians and num[1] in medians[num[0]] and den[1] in medians[den[0]]:
            value = medians[num[0]][num[1]] / medians[den[0]][den[1]]
        ratios.append({"name": label, "numerator": " ".join(num), "denominator": " ".join(den), "value": value,
                       "target": target, "pass": None if value is None or target is None else value >= target})

    targeted = TARGETS[cpu_kind]
    for label, num, den, target in targeted:
        ratio(label, num, den, target)
    explicit = [a for a in medians if split_arm(a)[0] == "hyprefix" and split_arm(a)[1] is not None]
    if "hyprefix" in medians and explicit:
        fastest = max(explicit, key=lambda a: medians[a]["prefill"])
        ratio(f"prefill hyprefix / fastest explicit dtype ({fastest})", ("hyprefix", "prefill"),
              (fastest, "prefill"), AUTO_PREFILL_TARGET)
    # Same-batch comparisons, informational (no target) unless the target set has them.
    if "hyprefix" in medians and "transformers" in medians:
        for b in cfg.batch_sizes:
            if b == 1 or any(n == ("hyprefix", f"decode@{b}") and d == ("transformers", f"decode@{b}")
                             for _, n, d, _ in targeted):
                continue
            ratio(f"decode hyprefix B={b} / transformers B={b}", ("hyprefix", f"decode@{b}"),
                  ("transformers", f"decode@{b}"), None)

    peak_fraction = {}
    for name in runs:
        seconds = statistics.median(t.seconds for t in runs[name]["prefill"])
        gflops = flops["total"] / seconds / 1e9
        peak_fraction[name] = {"prefill_gflops": gflops,
                               "fraction_of_peak": gflops / peak.gflops if peak is not None else None}

    agreement = _agreement(runs)
    return {
        "workload": "throughput",
        "config": {**cfg.__dict__, "batch_sizes": list(cfg.batch_sizes), "arms": list(cfg.arms),
                   "prompt_token_limit": PROMPT_TOKEN_LIMIT},
        "targets": cpu_kind,
        "model_shape": shape.to_dict(),
        "prefill_flops": flops,
        "medians_tokens_per_s": medians,
        "range_tokens_per_s": ranges,
        "disturbed_runs": {"count": disturbed, "of": len(contention), "threshold_other_cores": DISTURBED_CORES},
        "runs": {name: {case: [t.to_dict() for t in timings] for case, timings in cases.items()}
                 for name, cases in runs.items()},
        "ratios": ratios,
        "prefill_peak": peak_fraction,
        "greedy_agreement": agreement,
    }


def _agreement(runs: dict[str, dict[str, list[PrefillTiming | DecodeTiming]]]) -> dict[str, Any] | None:
    """How often both arms chose the same greedy tokens on the same prompts (a sanity
    check that they run the same weights; bf16 rounding can make near-ties diverge)."""
    if "hyprefix" not in runs or "transformers" not in runs:
        return None
    out: dict[str, Any] = {}
    for case, ours in runs["hyprefix"].items():
        theirs = runs["transformers"][case]
        if case == "prefill":
            same = sum(a.first_token == b.first_token for a, b in zip(ours, theirs, strict=True))
            out[case] = {"same_first_token": same, "of": len(ours)}
            continue
        first = total = seqs = identical = 0
        for a, b in zip(ours, theirs, strict=True):
            for x, y in zip(a.token_ids, b.token_ids, strict=True):
                seqs += 1
                first += x[0] == y[0]
                identical += x == y
                prefix = 0
                while prefix < min(len(x), len(y)) and x[prefix] == y[prefix]:
                    prefix += 1
                total += prefix
        out[case] = {"same_first_token": first, "identical_sequences": identical, "of": seqs,
                     "mean_common_prefix": total / seqs if seqs else 0.0}
    return out
