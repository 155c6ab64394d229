"""Which committed state checkpoint a full ``StatePool`` evicts (no torch).

``lru``: the least recently used (a commit or a hit counts as a use).

``cost-aware`` (Marconi, MLSys 2025, "Prefix Caching for the Era of Hybrid LLMs"): the one of
least utility = recency + ``alpha`` * FLOPs saved, both min-max normalised over the current
candidates (so each term lies in [0, 1] whatever the model's size or the pool's age). A
checkpoint at position L saves recomputing L tokens: ``RecomputeCost.flops_saved``, counted as
``bench/summary.prefill_flops`` counts a prefill (linear layers linear in L, attention layers'
scores quadratic; recurrent layers are in the linear term). Every slot has the same bytes, so
FLOPs per byte orders as FLOPs per slot. So a long conversation's checkpoint outlives a stream
of short one-off prompts' even when it is older, and among equally long ones the order is LRU's.

Admission (``admission``; off, no flag): a new checkpoint is refused when its own utility (as
the newest entry) is below the would-be victim's. Measured, it gained nothing that eviction alone
did not and lost hits on one workload (docs/benchmarks.md, 2026-11-29): the taps (``recurrent.py``)
already admit only states likely to be reused, as Marconi's admission does.

Retained checkpoints are not candidates: they go last, in LRU order, under either policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

POLICIES = ("lru", "cost-aware")  # config.STATE_EVICTION_POLICIES

# Marconi tunes alpha per workload; 1.0 weighs a full recency span like a full FLOPs span. Measured
# (tools/bench/checkpoint_policy.py, docs/benchmarks.md 2026-11-29) against 0.5 and 2: best or tied
# on both workloads at 32 and 64 slots; 2 alone kept a chat at 16 slots, but lost half the docs hits.
COST_AWARE_ALPHA = 1.0


@dataclass(frozen=True)
class RecomputeCost:
    """The prefill FLOPs a hit at position L saves: ``linear_flops_per_token * L +
    attention_flops_coeff * L**2 / 2`` (from the model's sizes: ``engine_stats.recompute_cost``)."""

    linear_flops_per_token: float = 0.0  # 2 x the linear layers' weights (the LM head excluded)
    attention_flops_coeff: float = 0.0  # 4 x attention layers x query width (QK^T and PV over a causal half)

    def flops_saved(self, position: int) -> float:
        return self.linear_flops_per_token * position + self.attention_flops_coeff * position * position / 2


def _normalised(values: Sequence[float]) -> list[float]:
    """Min-max over ``values``: the least 0, the greatest 1; all equal: all 0."""
    low, high = min(values), max(values)
    span = high - low
    return [(v - low) / span for v in values] if span > 0 else [0.0] * len(values)


def utilities(last_use: Sequence[float], flops: Sequence[float], alpha: float) -> list[float]:
    """Marconi's utility of each candidate: normalised recency + ``alpha`` * normalised FLOPs saved."""
    return [r + alpha * f for r, f in zip(_normalised(last_use), _normalised(flops), strict=True)]


@dataclass(frozen=True)
class CheckpointPolicy:
    """How a full checkpoint pool chooses its victim. Plain floats in, an index out."""

    name: str = "lru"  # one of ``POLICIES``
    cost: RecomputeCost = RecomputeCost()
    alpha: float = COST_AWARE_ALPHA
    admission: bool = False  # cost-aware only: refuse a new checkpoint worth less than its victim

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ValueError(f"checkpoint eviction policy must be one of {POLICIES}, got {self.name!r}")
        if not self.alpha >= 0:
            raise ValueError(f"alpha must be >= 0, got {self.alpha!r}")

    @property
    def cost_aware(self) -> bool:
        return self.name == "cost-aware"

    def flops_saved(self, position: int) -> float:
        return self.cost.flops_saved(position)

    def victim(self, last_use: Sequence[float], flops: Sequence[float]) -> int:
        """Index of the candidate to evict (candidates in LRU order, least recent first: a tie
        goes to the least recent). O(candidates)."""
        if not self.cost_aware:
            return 0
        scores = utilities(last_use, flops, self.alpha)
        return min(range(len(scores)), key=scores.__getitem__)

    def admits(self, last_use: Sequence[float], flops: Sequence[float], victim: int, new_use: float,
               new_flops: float) -> bool:
        """Whether a new checkpoint (last used ``new_use``, saving ``new_flops``) may take the
        slot of candidate ``victim``: always, but under cost-aware admission, where its utility,
        normalised together with the candidates', must reach the victim's."""
        if not (self.cost_aware and self.admission):
            return True
        scores = utilities([*last_use, new_use], [*flops, new_flops], self.alpha)
        return scores[-1] >= scores[victim]
