"""Helpers for the plain-data scheduler tests (no torch): build a scheduler wired as
``engine.py`` wires it (``cache.plan.build_cache``), drive it with a deterministic fake model, and read its cache."""

from __future__ import annotations

import time
from collections.abc import Callable

from hyprefix.cache.events import EventLog
from hyprefix.cache.kv import KVCacheManager
from hyprefix.cache.plan import build_cache
from hyprefix.cache.recurrent import RecurrentStateCache
from hyprefix.cache.retention import RetentionConfig
from hyprefix.cache.sliding import SlidingWindowKV
from hyprefix.outputs import ScheduledSeq, SchedulerOutput
from hyprefix.request import Request
from hyprefix.sampling import SamplingParams
from hyprefix.scheduler import Scheduler, SchedulerConfig


def make_scheduler(num_blocks: int, block_size: int, budget: int, max_seqs: int, caching: bool = True,
                   model_identity: str = "test-model", checkpoints: int | None = None,
                   attention: bool = True, window: int | None = None, window_blocks: int = 0,
                   events: EventLog | None = None, policy: str = "fcfs", max_wait_s: float | None = None,
                   clock: Callable[[], float] = time.time, retention: RetentionConfig | None = None) -> Scheduler:
    """A dense model by default; ``checkpoints``: add a recurrent state with that many
    checkpoint slots (a hybrid, or a pure recurrent model with ``attention=False``);
    ``window``: add sliding-window layers with a pool of ``window_blocks`` of their own;
    ``events``: the cache announces its changes there; ``policy``, ``max_wait_s``: the
    scheduling policy and its aging bound (``scheduling_policy.py``; None: the policy's
    default); ``clock``: the scheduler's time; ``retention``: the limits of finished requests'
    retentions (``cache/retention.py``)."""
    cache = build_cache(num_blocks, block_size, caching, model_identity, events, max_seqs, attention=attention,
                        window=window, window_blocks=window_blocks, checkpoints=checkpoints)
    return Scheduler(SchedulerConfig(budget, max_seqs, policy=policy, max_wait_s=max_wait_s,
                                     retention=retention or RetentionConfig()), cache, clock=clock)


def kv(s: Scheduler) -> KVCacheManager:
    return s.cache.kv


def window_kind(s: Scheduler) -> SlidingWindowKV:
    (kind,) = [k for k in s.cache.kinds if isinstance(k, SlidingWindowKV)]
    return kind


def state_kind(s: Scheduler) -> RecurrentStateCache:
    (kind,) = [k for k in s.cache.kinds if isinstance(k, RecurrentStateCache)]
    return kind


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def req(rid: str, prompt: list[int], max_tokens: int = 4, salt: str | None = None, **params) -> Request:
    params.setdefault("ignore_eos", True)
    return Request(rid, list(prompt), SamplingParams(temperature=0, max_tokens=max_tokens, **params),
                   cache_salt=salt)


def fake_token(request_id: str, position: int) -> int:
    """A deterministic "model": the token sampled at ``position`` depends only on the
    request and the position, as greedy decoding of a fixed prompt would."""
    return 5000 + 37 * sum(map(ord, request_id)) % 1000 + position


def expected_output(r: Request) -> list[int]:
    n = r.num_prompt_tokens
    return [fake_token(r.request_id, p) for p in range(n, n + r.params.max_tokens)]


def step(s: Scheduler, sampler: Callable[[str, int], int] = fake_token,
         check: Callable[[Scheduler], None] = Scheduler.check_invariants,
         on_plan: Callable[[SchedulerOutput], None] | None = None) -> SchedulerOutput:
    """One schedule + update with ``check`` before, between and after."""
    check(s)
    out = s.schedule()
    check(s)
    if on_plan is not None:
        on_plan(out)
    sampled = {q.request_id: sampler(q.request_id, q.context_len) for q in out.seqs if q.sample}
    s.update(out, sampled)
    check(s)
    return out


def run_to_end(s: Scheduler, max_steps: int = 1000, **step_kw) -> list[SchedulerOutput]:
    outs = []
    for _ in range(max_steps):
        if not s.has_unfinished():
            s.check_invariants()
            return outs
        outs.append(step(s, **step_kw))
    raise AssertionError("scheduler did not finish")


def plan(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    """(request id, start position, number of tokens, samples) of every scheduled seq."""
    return [(q.request_id, q.start_pos, q.num_tokens, q.sample) for q in out.seqs]


def seq_of(out: SchedulerOutput, rid: str) -> ScheduledSeq:
    (q,) = [q for q in out.seqs if q.request_id == rid]
    return q
