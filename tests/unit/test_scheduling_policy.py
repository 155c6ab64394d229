"""The scheduling policies (``scheduling_policy.py``) on plain data, no model: priority order and
ties, the priority preemption victim, priority refused outside the priority policy and capped by
``--highest-request-priority``, cache-aware admission preferring hits, both policies' aging bound
under an injected clock, fair shares between tenants, no starvation under a stream of hot or
urgent requests, and the scan limit."""

from __future__ import annotations

import math
import zlib
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyprefix.config import SCHEDULING_POLICIES, EngineArgs
from hyprefix.errors import RequestError
from hyprefix.request import Request, Status
from hyprefix.sampling import MAX_PRIORITY, MIN_PRIORITY, SamplingParams
from hyprefix.scheduler import SCAN_MIN, SCAN_PER_SEQ, Scheduler, SchedulerConfig
from hyprefix.scheduling_policy import (
    DEFAULT_MAX_WAIT_S,
    DEFAULT_PRIORITY_MAX_WAIT_S,
    POLICIES,
    check_priority,
    fair_turns,
    grant_priority,
)
from hyprefix.speculative import SpeculativeConfig
from hyprefix.wait_queue import WaitQueue
from tests.support.plain_scheduling import expected_output, kv, make_scheduler, run_to_end, step, toks

HOT = toks(1000, 16)  # four blocks of 4 tokens, cached by ``warm``


class Clock:
    """The scheduler's time, moved by the test."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def make(policy: str, clock: Clock | None = None, num_blocks: int = 256, budget: int = 64, max_seqs: int = 1,
         caching: bool = True, max_wait_s: float | None = None) -> Scheduler:
    return make_scheduler(num_blocks, 4, budget, max_seqs, caching, policy=policy, max_wait_s=max_wait_s,
                          clock=clock or Clock())


def req(rid: str, prompt: list[int], max_tokens: int = 1, priority: int = 0, arrival: float = 0.0,
        salt: str | None = None, group: str | None = None) -> Request:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, priority=priority)
    return Request(rid, list(prompt), params, cache_salt=salt, group=group, arrival_time=arrival)


def _start(rid: str, base: int) -> int:
    return base + zlib.crc32(rid.encode()) % 100_000 * 32  # no two ids' prompts alike


def cold(rid: str, arrival: float = 0.0, **kw) -> Request:
    """18 tokens, none cached."""
    return req(rid, toks(_start(rid, 10_000), 18), arrival=arrival, **kw)


def hot(rid: str, arrival: float = 0.0, **kw) -> Request:
    """HOT and two tokens of its own: 16 tokens cached once ``warm`` ran."""
    return req(rid, HOT + toks(_start(rid, 10_000_000), 2), arrival=arrival, **kw)


def warm(s: Scheduler) -> None:
    """Cache HOT's four blocks (a finished request leaves them findable)."""
    s.add_request(req("warm", [*HOT, 1], arrival=-1.0))
    run_to_end(s)
    assert s.cache.cached_tokens(hot("probe")) == 16


def first_scheduled(s: Scheduler, max_steps: int = 500, clock: Clock | None = None) -> list[str]:
    """Run to the end; request ids in the order they were first scheduled (the clock moves 1 s a step)."""
    seen: list[str] = []
    for _ in range(max_steps):
        if not s.has_unfinished():
            return seen
        for q in step(s).seqs:
            if q.request_id not in seen:
                seen.append(q.request_id)
        if clock is not None:
            clock.t += 1.0
    raise AssertionError("scheduler did not finish")


# ------------------------------------------------------------------- flags and validation
def test_the_flags_defaults_and_validation():
    assert SCHEDULING_POLICIES == POLICIES == ("fcfs", "priority", "cache-aware")
    args = EngineArgs()
    assert args.scheduling_policy == "fcfs" and args.scheduling_max_wait_s is None
    assert args.highest_request_priority is None
    assert SchedulerConfig(1, 1).policy == "fcfs" and SchedulerConfig(1, 1).max_wait_s is None
    assert make("cache-aware").policy.max_wait_s == DEFAULT_MAX_WAIT_S == 3.0
    assert make("priority").policy.max_wait_s == DEFAULT_PRIORITY_MAX_WAIT_S == 60.0
    for bad in ({"scheduling_policy": "lifo"}, {"scheduling_policy": "lpm"}, {"scheduling_max_wait_s": -1},
                {"scheduling_max_wait_s": math.nan}, {"scheduling_max_wait_s": math.inf},
                {"scheduling_max_wait_s": "3"}):
        with pytest.raises(ValueError, match="scheduling_"):
            EngineArgs(**bad)
    assert EngineArgs(scheduling_policy="cache-aware", scheduling_max_wait_s=0).scheduling_max_wait_s == 0
    for bad in ({"highest_request_priority": 1.5}, {"highest_request_priority": MIN_PRIORITY - 1},
                {"highest_request_priority": True}, {"highest_request_priority": 0, "scheduling_policy": "fcfs"}):
        with pytest.raises(ValueError, match="highest_request_priority"):
            EngineArgs(**{"scheduling_policy": "priority", **bad})


def test_priority_is_refused_outside_the_priority_policy_and_checked():
    check_priority("priority", 7)
    check_priority("priority", -3)
    for policy in ("fcfs", "cache-aware"):
        check_priority(policy, 0)
        with pytest.raises(RequestError, match="scheduling-policy priority") as info:
            check_priority(policy, 1)
        assert info.value.param == "priority"
    assert SamplingParams().priority == 0
    assert SamplingParams(priority=MIN_PRIORITY).priority == MIN_PRIORITY
    for bad in (1.5, "1", True, None, MAX_PRIORITY + 1, MIN_PRIORITY - 1):
        with pytest.raises(RequestError) as info:
            SamplingParams(priority=bad)
        assert info.value.param == "priority"
    assert SamplingParams(n=3, priority=4).for_sample(2).priority == 4


def test_a_tenant_is_the_api_key_bound_to_the_salt_or_the_salt():
    assert req("a", [1], salt=None).tenant is None
    assert req("a", [1], salt="team-a").tenant == "team-a"
    assert req("a", [1], salt="0f3a|client-salt").tenant == "0f3a"  # server.serving.engine_salt's form
    assert req("a", [1], salt="0f3a|").tenant == "0f3a"


# ------------------------------------------------------------------------------ priority
def test_priority_admits_lower_values_first_ties_by_arrival():
    s = make("priority", caching=False)
    for rid, priority, arrival in [("a", 3, 0.0), ("b", 1, 1.0), ("c", 2, 2.0), ("d", 1, 0.5), ("e", -1, 9.0)]:
        s.add_request(cold(rid, arrival, priority=priority))  # d is added after b but arrived before it
    assert first_scheduled(s) == ["e", "d", "b", "c", "a"]
    fcfs = make("fcfs", caching=False)  # the scheduler itself ignores priority under fcfs
    for rid, priority, arrival in [("a", 3, 0.0), ("b", 1, 1.0), ("c", 2, 2.0)]:
        fcfs.add_request(cold(rid, arrival, priority=priority))
    assert first_scheduled(fcfs) == ["a", "b", "c"]


def test_priority_preempts_the_lowest_priority_running_request():
    # 4 blocks of 4 tokens: three 4-token prompts take three; each needs a second block next step.
    def run(policy: str) -> tuple[list[str], list[str]]:
        s = make(policy, num_blocks=4, max_seqs=3, caching=False)
        for rid, priority, arrival in [("a", 0, 0.0), ("b", 5, 1.0), ("c", 1, 2.0)]:
            s.add_request(req(rid, toks(10 * (ord(rid) - 96), 4), max_tokens=6, priority=priority, arrival=arrival))
        step(s)
        out = step(s)
        return out.preempted_ids, [q.request_id for q in out.seqs]

    assert run("fcfs") == (["c"], ["a", "b"])  # the newest
    assert run("priority") == (["b"], ["a", "c"])  # the lowest priority, though not the newest


def test_among_equal_priorities_the_latest_arrival_is_preempted_first():
    s = make("priority", num_blocks=4, max_seqs=3, caching=False)
    for rid, arrival in [("a", 0.0), ("b", 2.0), ("c", 1.0)]:  # admitted a, b, c; c arrived before b
        s.add_request(req(rid, toks(10 * (ord(rid) - 96), 4), max_tokens=6, arrival=arrival))
    step(s)
    assert [r.request_id for r in s.running] == ["a", "c", "b"]
    out = step(s)
    assert out.preempted_ids == ["b"]
    run_to_end(s)


def test_a_later_higher_priority_request_runs_before_a_lower_one_in_prefill():
    s = make("priority", budget=8, max_seqs=4, caching=False)
    lo = req("lo", toks(100, 20), max_tokens=3, priority=5)
    s.add_request(lo)
    step(s)  # lo's first chunk of 8
    hi = req("hi", toks(300, 4), max_tokens=3, priority=0, arrival=1.0)
    s.add_request(hi)
    step(s)  # lo's second chunk takes the whole budget
    step(s)  # lo's last 4 tokens, then hi
    assert [r.request_id for r in s.running] == ["hi", "lo"]
    out = step(s)
    assert [q.request_id for q in out.seqs] == ["hi", "lo"]  # hi gets the budget first
    run_to_end(s)
    assert lo.output_token_ids == expected_output(lo) and hi.output_token_ids == expected_output(hi)


def test_fairness_preemption_under_priority_only_for_a_head_of_no_lower_priority():
    s = make("priority", max_seqs=4, caching=False)
    for i in range(8):
        s.add_request(req(f"big-{i}", toks(100 * i, 3), max_tokens=40, group="big"))
    step(s)
    low = req("low", toks(2000, 3), max_tokens=2, priority=5, arrival=1.0)
    s.add_request(low)
    out = step(s)
    assert out.preempted_ids == []  # preempting for it would only put big-3 back first
    equal = req("equal", toks(3000, 3), max_tokens=2, priority=0, arrival=2.0)
    s.add_request(equal)
    out = step(s)
    assert out.preempted_ids == ["big-3"] and "equal" in [q.request_id for q in out.seqs]
    run_to_end(s)
    assert low.output_token_ids == expected_output(low)


def test_a_priority_above_the_highest_allowed_is_capped_to_it():
    assert [grant_priority(p, None) for p in (-5, 0, 7)] == [-5, 0, 7]
    assert [grant_priority(p, 0) for p in (-5, 0, 7)] == [0, 0, 7]
    assert grant_priority(MIN_PRIORITY, -3) == -3


def test_a_steady_stream_of_urgent_requests_does_not_starve_a_low_priority_one():
    """Aging (vLLM's priority policy has none): the low one is promoted after the bound, then
    runs ahead of every priority; without aging it waits for the whole stream."""
    def low_wait(max_wait_s: float) -> tuple[float, int]:
        clock = Clock()
        s = make("priority", clock, max_wait_s=max_wait_s, caching=False)
        low = cold("low", clock.t, max_tokens=2, priority=9)
        s.add_request(low)
        stream = []
        for i in range(40):  # one urgent request a step, each holds the one slot for 2 steps
            stream.append(cold(f"u{i}", clock.t, max_tokens=2, priority=-1))
            s.add_request(stream[-1])
            step(s)
            clock.t += 1.0
        first_scheduled(s, clock=clock)
        assert low.is_finished and all(r.is_finished for r in stream)
        return low.first_scheduled_time - low.arrival_time, sum(
            r.first_scheduled_time < low.first_scheduled_time for r in stream)

    wait, urgent_before = low_wait(5.0)
    assert urgent_before > 0 and wait <= 5.0 + 2 + 1
    starved, _ = low_wait(1e9)
    assert starved >= 40


def test_an_aged_request_ranks_first_while_running_too():
    """Once promoted it is not the next preemption victim: the lowest priority not aged is."""
    clock = Clock()
    s = make("priority", clock, num_blocks=4, max_seqs=3, caching=False, max_wait_s=2.0)
    old = req("old", toks(10, 4), max_tokens=6, priority=50, arrival=0.0)
    s.add_request(old)
    clock.t = 2.0
    for rid, priority in [("a", 0), ("b", 5)]:
        s.add_request(req(rid, toks(100 * ord(rid), 4), max_tokens=6, priority=priority, arrival=2.0))
    step(s)
    assert old.aged and [r.request_id for r in s.running] == ["old", "a", "b"]
    assert step(s).preempted_ids == ["b"]
    run_to_end(s)
    assert old.output_token_ids == expected_output(old)


# --------------------------------------------------------------------------- cache-aware
@pytest.mark.parametrize("policy, first", [("cache-aware", "h1"), ("fcfs", "c1")])
def test_cache_aware_admits_the_request_with_more_cached_tokens_first(policy, first):
    s = make(policy)
    warm(s)
    c1, h1 = cold("c1", 0.0), hot("h1", 0.5)
    s.add_request(c1)
    s.add_request(h1)
    assert first_scheduled(s) == [first, "c1" if first == "h1" else "h1"]
    assert (h1.num_cached_tokens, c1.num_cached_tokens) == (16, 0)


def test_cached_tokens_is_a_pure_query():
    s = make("cache-aware")
    warm(s)
    pool = kv(s).pool
    free_before, used_before = list(pool._free), pool.num_used
    probe = hot("probe")
    assert s.cache.cached_tokens(probe) == 16
    assert list(pool._free) == free_before and pool.num_used == used_before  # nothing taken, no LRU moved
    assert s.cache.cached_tokens(req("full", HOT)) == 15  # a full hit still computes its last token
    assert s.cache.cached_tokens(req("warm-again", [*HOT, 1])) == 16
    asks = Request("pl", [*HOT, 1], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    assert s.cache.cached_tokens(asks) == 0  # it computes its whole prompt


@pytest.mark.parametrize("now, first", [(2.9, "h1"), (3.0, "c1")])
def test_a_request_waiting_past_the_bound_goes_before_cache_preferred_ones(now, first):
    clock = Clock()
    s = make("cache-aware", clock, max_wait_s=3.0)
    warm(s)
    s.add_request(cold("c1", 0.0))
    s.add_request(cold("c2", 0.1))
    for i in range(3):
        s.add_request(hot(f"h{i + 1}", 0.5))
    clock.t = now
    order = first_scheduled(s, clock=clock)
    assert order[0] == first
    if first == "c1":  # c2's FCFS turn came when c1 was admitted (3.0, a step a second): aged at 6.0
        assert order == ["c1", "h1", "h2", "c2", "h3"]


def test_ahead_of_new_is_the_place_fcfs_order_gives_a_request_appended_now():
    queue = WaitQueue()
    for rid, group in [("a1", "A"), ("a2", "A"), ("a3", "A"), ("b1", "B"), ("c1", None)]:
        queue.append(cold(rid, group=group))
    running = Counter({"B": 2})
    for rid, group in [("new", None), ("a4", "A"), ("b2", "B"), ("d1", "D")]:
        r = cold(rid, group=group)
        probe = WaitQueue()
        for w in queue:
            probe.append(w)
        probe.append(r)
        order = [w.request_id for w in probe.in_turn(running.__getitem__)]
        assert queue.ahead_of_new(r, running) == order.index(rid), (rid, order)


def test_cache_aware_ages_a_request_from_its_fcfs_turn_not_from_its_arrival():
    """A burst longer than the bound, one admission per 0.5-s step: aged from its arrival, the
    cold request behind 6 others would go before the hot ones that came after it at 2 s. Its
    FCFS turn comes with the 6th admission (2.5 s), and it ages 2 s after that."""
    clock = Clock()
    s = make("cache-aware", clock, max_wait_s=2.0, caching=True)
    warm(s)
    early = [cold(f"e{i}", 0.0) for i in range(6)]
    for r in early:
        s.add_request(r)
    c = cold("cold", 0.0)
    s.add_request(c)
    hots = []
    for i in range(8):
        hots.append(hot(f"h{i}", clock.t))
        s.add_request(hots[-1])
    while not c.is_finished:
        step(s)
        clock.t += 0.5
    assert c.fcfs_due_time == 2.5
    assert c.first_scheduled_time - c.fcfs_due_time >= 2.0  # the bound, counted from its turn
    assert [h.request_id for h in hots if h.first_scheduled_time is not None] == ["h0", "h1", "h2", "h3"]
    run_to_end(s)


def test_cache_aware_ranks_by_the_length_of_the_hit():
    s = make("cache-aware")
    warm(s)
    s.add_request(cold("c", 0.0))
    s.add_request(req("half", [*HOT[:8], *toks(7000, 10)], arrival=0.1))  # two blocks cached
    s.add_request(hot("whole", 0.2))  # four blocks cached
    assert first_scheduled(s) == ["whole", "half", "c"]


def test_a_steady_stream_of_hot_requests_does_not_starve_a_cold_one():
    def cold_wait(max_wait_s: float) -> tuple[float, int]:
        clock = Clock()
        s = make("cache-aware", clock, max_wait_s=max_wait_s)
        warm(s)
        c = cold("cold", clock.t, max_tokens=2)
        s.add_request(c)
        stream = []
        for i in range(40):  # one hot request a step, each holds the one slot for 2 steps
            stream.append(hot(f"h{i}", clock.t, max_tokens=2))
            s.add_request(stream[-1])
            step(s)
            clock.t += 1.0
        first_scheduled(s, clock=clock)
        assert c.is_finished and all(r.is_finished for r in stream)
        hot_before = sum(r.first_scheduled_time < c.first_scheduled_time for r in stream)
        return c.first_scheduled_time - c.arrival_time, hot_before

    wait, hot_before = cold_wait(5.0)
    assert hot_before > 0  # the hot ones were preferred while it was young
    assert wait <= 5.0 + 2 + 1  # then it went first: the bound plus one request's turn
    starved, _ = cold_wait(1e9)  # longest-prefix-first without aging: it waits for the whole stream
    assert starved >= 40


@pytest.mark.parametrize("policy", ["cache-aware", "priority"])
@settings(max_examples=30, deadline=None)
@given(arrivals=st.lists(st.lists(st.booleans(), max_size=3), min_size=1, max_size=16),
       max_wait_s=st.sampled_from([0.0, 1.0, 3.0, 6.0]), max_tokens=st.integers(1, 3))
def test_no_request_waits_more_than_the_bound_beyond_the_requests_before_it(policy, arrivals, max_wait_s,
                                                                             max_tokens):
    """One slot; every request holds it ``max_tokens`` steps of 1 s; hot requests are cached
    (cache-aware) or urgent (priority -1 against 3). Once a request has aged only older ones go
    before it. Under priority it ages the bound after it arrived, so it waits at most the bound
    plus one turn for each request that arrived before it and one for the request running then.
    Under cache-aware it ages the bound after its FCFS turn, which comes within one turn per
    request waiting ahead of it on arrival (at most every one before it) plus the running one's:
    a turn more per request before it. Either way nothing waits forever."""
    clock = Clock()
    s = make(policy, clock, max_wait_s=max_wait_s, num_blocks=512)
    warm(s)
    added: list[Request] = []
    for step_arrivals in arrivals:
        for is_hot in step_arrivals:
            priority = (-1 if is_hot else 3) if policy == "priority" else 0
            r = (hot if is_hot else cold)(f"r{len(added)}", clock.t, max_tokens=max_tokens, priority=priority)
            s.add_request(r)
            added.append(r)
        step(s)
        clock.t += 1.0
    for _ in range(1000):
        if not s.has_unfinished():
            break
        step(s)
        clock.t += 1.0
    for before, r in enumerate(added):
        assert r.is_finished
        turns = before + 1 + (before + 1 if policy == "cache-aware" else 0)  # cache-aware: its FCFS turn's too
        assert r.first_scheduled_time - r.arrival_time <= max_wait_s + max_tokens * turns + 1


# ------------------------------------------------------------------------- tenant shares
@pytest.mark.parametrize("policy, first", [("priority", "b1"), ("cache-aware", "b1"), ("fcfs", "a3")])
def test_among_equals_a_tenant_with_fewer_running_requests_goes_first(policy, first):
    s = make(policy, max_seqs=3, caching=False)
    s.add_request(cold("a1", 0.0, salt="A", max_tokens=20))
    s.add_request(cold("a2", 0.0, salt="A", max_tokens=20))
    step(s)
    s.add_request(cold("a3", 0.5, salt="A"))  # earlier, but tenant A runs two already
    s.add_request(cold("b1", 1.0, salt="B"))
    out = step(s)
    assert [q.request_id for q in out.seqs][-1] == first
    run_to_end(s)


def test_fair_turns_rotate_tenants_fewest_running_first():
    rs = [cold("a1", salt="A"), cold("a2", salt="A"), cold("b1", salt="B"), cold("c1", salt="C"),
          cold("b2", salt="B"), cold("g1")]
    running = {("tenant", "A"): 0, ("tenant", "B"): 2, ("tenant", "C"): 1}
    assert [r.request_id for r in fair_turns(rs, running)] == ["a1", "g1", "c1", "b1", "a2", "b2"]
    assert fair_turns(rs[:2], running) == rs[:2]


def test_fairness_preemption_under_cache_aware_waits_for_the_bound():
    clock = Clock()
    s = make("cache-aware", clock, max_seqs=4, caching=False, max_wait_s=3.0)
    for i in range(8):
        s.add_request(req(f"big-{i}", toks(100 * i, 3), max_tokens=40, group="big"))
    step(s)
    small = req("small", toks(2000, 3), max_tokens=2, arrival=0.0)
    s.add_request(small)
    assert step(s).preempted_ids == []  # big-3 preempted now would come back first (its blocks are cached)
    clock.t = 3.0
    out = step(s)
    assert out.preempted_ids == ["big-3"] and "small" in [q.request_id for q in out.seqs]
    run_to_end(s)
    assert small.output_token_ids == expected_output(small)


# ----------------------------------------------------------------- what every policy keeps
@pytest.mark.parametrize("policy", POLICIES)
def test_admission_looks_at_a_bounded_number_of_waiting_requests(policy, monkeypatch):
    s = make(policy, num_blocks=64, max_seqs=2)
    shared = toks(700, 40)
    priorities = [(37 * i) % 600 - 300 if policy == "priority" else 0 for i in range(600)]
    for i in range(600):  # 600 samples of one prompt: all but one wait for its blocks
        s.add_request(req(f"r{i}", shared, priority=priorities[i], group="fanout"))
    looked: set[str] = set()
    match = kv(s).match_prefix
    monkeypatch.setattr(kv(s), "match_prefix", lambda r: looked.add(r.request_id) or match(r))
    step(s)
    limit = max(SCAN_MIN, SCAN_PER_SEQ * 2)
    assert 0 < len(looked) <= limit
    if policy == "priority":  # the best ones
        best = {f"r{i}" for i in sorted(range(600), key=lambda i: priorities[i])[:limit]}
        assert looked <= best
    monkeypatch.undo()
    run_to_end(s, max_steps=1000, check=lambda _: None)  # checked once at the end
    assert kv(s).pool.num_used == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_keeps_chunks_preemption_and_sibling_waits(policy):
    """A small pool (preemption), a small budget (chunks), shared prefixes (sibling waits), two
    tenants and mixed priorities: every request ends with the tokens it would alone."""
    clock = Clock()
    s = make(policy, clock, num_blocks=20, budget=64, max_seqs=5)
    shared = toks(400, 24)
    reqs = []
    for i in range(16):
        prompt = shared + toks(1000 * i, 1 + (5 * i) % 7) if i % 3 else toks(2000 + 50 * i, 3 + (7 * i) % 13)
        reqs.append(req(f"r{i}", prompt, max_tokens=3 + (5 * i) % 9, priority=(i % 4) if policy == "priority" else 0,
                        arrival=0.1 * i, salt="A" if i % 3 else "AB"[i % 2]))
    reqs.append(req("long", toks(9000, 70), max_tokens=3, arrival=0.05, salt="B"))  # more than a step's budget
    for r in reqs:
        s.add_request(r)
    chunks = 0
    for _ in range(2000):
        if not s.has_unfinished():
            break
        chunks += sum(not q.sample for q in step(s).seqs)
        clock.t += 0.5
    assert not s.has_unfinished()
    for r in reqs:
        assert r.is_finished and r.output_token_ids == expected_output(r), r.request_id
    assert s.num_preemptions > 0 and s.sibling_waits > 0 and chunks > 0
    assert kv(s).pool.num_used == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_keeps_draft_rows(policy):
    base = make_scheduler(32, 4, 64, 4)
    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=2)
    s = Scheduler(SchedulerConfig(64, 4, speculative=spec, policy=policy), base.cache)
    s.add_request(req("a", [1, 2, 3, 1, 2, 3, 1], max_tokens=20))
    s.update(s.schedule(), {"a": [2]})
    (seq,) = s.schedule().seqs
    assert seq.num_drafts == 4 and seq.token_ids == [2, 3, 1, 2, 3]
    assert s.requests["a"].status == Status.RUNNING
