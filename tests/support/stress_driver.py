"""The randomized traffic loop shared by the engine stress tests (dense and hybrid,
prefix cache on or off): requests arrive a few per step, some are aborted, the
cache may be reset once, finished conversations may continue with their own output,
streamed outputs only grow, and the invariants are checked after every step.
``verify`` then checks that nothing leaked and that greedy tokens equal a run with
prefix caching off."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from hyprefix import LLM, SamplingParams
from hyprefix.errors import RequestError
from hyprefix.request import Request


def rng_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 4096) for _ in range(n)]


@dataclass
class StressRun:
    added: dict[str, tuple[dict, SamplingParams]] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)  # request id -> the RequestError's message
    samples: dict[str, Request] = field(default_factory=dict)  # sequence id -> its Request (preemption counts)
    last: dict[str, object] = field(default_factory=dict)  # request id -> latest RequestOutput
    aborted: set[str] = field(default_factory=set)
    num_followups: int = 0
    reset_done: bool = False


def drive(llm: LLM, rng: random.Random, todo: list[tuple[str, dict, SamplingParams]], *, block_size: int,
          max_prompt: int, abort_p: float, reset_step: int, follow_p: float, follow_max_tokens: int,
          max_steps: int, check: Callable[[], None] = lambda: None,
          arrivals: tuple[int, ...] = (0, 0, 0, 1, 1, 2),
          events: dict[int, Callable[[], None]] | None = None) -> StressRun:
    """``arrivals``: how many requests may arrive in a step (one is drawn per step);
    ``reset_step`` -1 never resets the cache, ``follow_p`` 0 never follows up; ``events``: step
    number -> something done before that step (a weight update), the invariants checked after it.
    A request the engine rejects (``RequestError``) is recorded in ``rejected``, not added."""
    engine = llm.engine
    run = StressRun()
    followed: set[str] = set()
    num_kv_blocks = engine.get_stats()["kv_blocks_total"]

    def check_all() -> None:
        engine.check_invariants()
        check()

    for step_no in range(max_steps):
        for _ in range(rng.choice(arrivals)):
            if not todo:
                break
            rid, item, params = todo.pop(0)
            try:
                engine.add_request(rid, item, params)
            except RequestError as exc:
                run.rejected[rid] = str(exc)
                continue
            run.added[rid] = (item, params)
            for i in range(params.n):
                sid = rid if params.n == 1 else f"{rid}#{i}"
                run.samples[sid] = engine.scheduler.requests[sid]
        if run.added and rng.random() < abort_p:
            rid = rng.choice(sorted(run.added))
            was_live = rid not in run.last or not run.last[rid].finished
            assert engine.abort(rid) is was_live
            if was_live:
                run.aborted.add(rid)
            check_all()
        if events and step_no in events:
            events[step_no]()
            check_all()
        if not run.reset_done and step_no == reset_step:
            cached = engine.get_stats()["kv_blocks_cached"]
            assert llm.reset_prefix_cache() == cached
            assert engine.get_stats()["kv_blocks_cached"] == 0
            check_all()  # checkpoints on the dropped blocks are gone too
            run.reset_done = True
        for out in engine.step():
            prev = run.last.get(out.request_id)
            assert prev is None or not prev.finished, f"{out.request_id} reported after it finished"
            if prev is not None:  # streamed tokens only ever grow
                for a, b in zip(prev.outputs, out.outputs, strict=True):
                    assert b.token_ids[:len(a.token_ids)] == a.token_ids
            run.last[out.request_id] = out
            # Multi-turn: a finished conversation continues with its own output.
            if out.finished and out.request_id not in run.aborted and out.request_id not in followed \
                    and follow_p > 0 and rng.random() < follow_p:
                followed.add(out.request_id)
                item, _ = run.added[out.request_id]
                follow = item["prompt_token_ids"] + list(out.outputs[0].token_ids) + rng_tokens(
                    rng, rng.randint(1, block_size + 2))
                if len(follow) <= max_prompt:
                    new_params = SamplingParams(temperature=0, max_tokens=rng.randint(1, follow_max_tokens),
                                                ignore_eos=True)
                    todo.insert(rng.randint(0, min(3, len(todo))),
                                (f"{out.request_id}.t{run.num_followups}", dict(item, prompt_token_ids=follow),
                                 new_params))
                    run.num_followups += 1
        check_all()
        assert engine.get_stats()["kv_blocks_used"] <= num_kv_blocks
        if not todo and not engine.has_unfinished():
            return run
    raise AssertionError(f"not done after {max_steps} steps: {engine.get_stats()}")


def verify(llm: LLM, ref_llm: LLM, run: StressRun, num_requests: int) -> list[str]:
    """Nothing leaked, every request finished or was aborted, and the finished ones got
    the greedy tokens of ``ref_llm`` (prefix caching off). Returns the finished ids."""
    engine = llm.engine
    stats = engine.get_stats()
    assert stats["kv_blocks_used"] == 0, "blocks leaked"
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0
    assert engine.scheduler.requests == {}
    assert set(run.last) == set(run.added)
    assert not run.rejected and len(run.added) == num_requests + run.num_followups
    for rid, (_, params) in run.added.items():
        out = run.last[rid]
        assert out.finished and len(out.outputs) == params.n, rid
        for c in out.outputs:
            assert c.finish_reason in ("stop", "length", "abort"), rid
            if c.finish_reason == "abort":
                assert rid in run.aborted

    done = [rid for rid in run.added if rid not in run.aborted]
    assert len(done) > num_requests // 2
    refs = ref_llm.generate([run.added[rid][0] for rid in done], [run.added[rid][1] for rid in done],
                            use_tqdm=False)
    assert ref_llm.get_stats()["prefix_cache_hits"] == 0
    mismatches = []
    for rid, ref in zip(done, refs, strict=True):
        got = [c.token_ids for c in run.last[rid].outputs]
        want = [c.token_ids for c in ref.outputs]
        if got != want:
            mismatches.append((rid, run.last[rid].num_cached_tokens, got, want))
    assert not mismatches, f"{len(mismatches)} of {len(done)} requests differ, e.g. {mismatches[:3]}"
    return done
