"""Exact unit tests of the step planner, driven with fake sampled tokens (plain data, no torch)."""

from __future__ import annotations

import pytest

from hyprefix.request import Request, Status
from hyprefix.sampling import SamplingParams
from hyprefix.scheduler import Scheduler
from tests.support.plain_scheduling import expected_output, fake_token, kv, make_scheduler, plan, run_to_end, step


def make(num_blocks: int = 16, block_size: int = 4, budget: int = 16, max_seqs: int = 8,
         caching: bool = False) -> Scheduler:
    """Prefix caching is off unless asked for: these tests pin the base scheduling."""
    return make_scheduler(num_blocks, block_size, budget, max_seqs, caching)


def prompt_of(rid: str, n: int) -> list[int]:
    base = 100 * (1 + sum(map(ord, rid)) % 30)
    return [base + i for i in range(n)]


def req(rid: str, n_prompt: int, max_tokens: int = 4, **kw) -> Request:
    return Request(rid, prompt_of(rid, n_prompt), SamplingParams(temperature=0, max_tokens=max_tokens, **kw))


# ----------------------------------------------------------------------------- basics
def test_single_request_lifecycle():
    s = make()
    a = req("a", 6, max_tokens=3)
    s.add_request(a)
    assert (s.num_waiting, s.num_running) == (1, 0) and a.status == Status.WAITING
    out = step(s)
    assert plan(out) == [("a", 0, 6, True)]
    assert out.num_batched_tokens == 6
    assert out.seqs[0].token_ids == a.prompt_token_ids
    assert out.seqs[0].block_table == [0, 1]
    assert a.status == Status.RUNNING and a.num_computed_tokens == 6
    assert a.output_token_ids == [fake_token("a", 6)]
    out = step(s)
    assert plan(out) == [("a", 6, 1, True)]
    assert out.seqs[0].token_ids == [fake_token("a", 6)]
    assert out.seqs[0].num_generated == 1
    out = step(s)
    assert plan(out) == [("a", 7, 1, True)]
    assert out.seqs[0].block_table == [0, 1]
    assert a.is_finished and a.finish_reason == "length"
    assert a.output_token_ids == expected_output(a)
    assert not s.has_unfinished() and kv(s).pool.num_used == 0
    out = s.schedule()
    assert out.is_empty and out.finished_ids == ["a"]
    assert s.schedule().finished_ids == []  # reported once


def test_duplicate_request_id_is_rejected():
    s = make()
    s.add_request(req("a", 3))
    with pytest.raises(ValueError):
        s.add_request(req("a", 5))
    assert s.num_waiting == 1 and s.requests["a"].num_prompt_tokens == 3


def test_token_budget_is_respected():
    s = make(num_blocks=32, budget=16)
    for rid in ("a", "b", "c"):
        s.add_request(req(rid, 10, max_tokens=3))
    out = step(s)
    assert plan(out) == [("a", 0, 10, True), ("b", 0, 6, False)]
    assert out.num_batched_tokens == 16
    out = step(s)
    # running first (a decodes, b finishes its prompt), then c gets what is left
    assert plan(out) == [("a", 10, 1, True), ("b", 6, 4, True), ("c", 0, 10, True)]
    assert out.num_batched_tokens == 15
    outs = run_to_end(s)
    for o in outs:
        assert o.num_batched_tokens == sum(q.num_tokens for q in o.seqs) <= 16


def test_max_num_seqs_is_respected():
    s = make(num_blocks=32, budget=64, max_seqs=2)
    reqs = [req(rid, 3, max_tokens=2) for rid in ("a", "b", "c")]
    for r in reqs:
        s.add_request(r)
    out = step(s)
    assert [q.request_id for q in out.seqs] == ["a", "b"]
    assert s.num_running == 2 and s.num_waiting == 1
    out = step(s)  # a and b finish on this step
    assert plan(out) == [("a", 3, 1, True), ("b", 3, 1, True)]
    assert reqs[0].is_finished and reqs[1].is_finished
    out = step(s)
    assert plan(out) == [("c", 0, 3, True)]
    for o in run_to_end(s):
        assert len(o.seqs) <= 2
    assert reqs[2].output_token_ids == expected_output(reqs[2])


def test_chunked_prefill_uses_the_whole_budget_and_samples_on_the_last_chunk():
    s = make(num_blocks=16, block_size=4, budget=8)
    a = req("a", 21, max_tokens=2)
    s.add_request(a)
    chunks = [step(s) for _ in range(3)]
    assert [plan(o) for o in chunks] == [[("a", 0, 8, False)], [("a", 8, 8, False)], [("a", 16, 5, True)]]
    assert [o.seqs[0].token_ids for o in chunks] == [a.prompt_token_ids[0:8], a.prompt_token_ids[8:16],
                                                      a.prompt_token_ids[16:21]]
    assert [o.seqs[0].block_table for o in chunks] == [[0, 1], [0, 1, 2, 3], [0, 1, 2, 3, 4, 5]]
    assert a.output_token_ids == [fake_token("a", 21)]
    out = step(s)
    assert plan(out) == [("a", 21, 1, True)]
    assert out.seqs[0].block_table == [0, 1, 2, 3, 4, 5]
    assert a.is_finished and a.output_token_ids == expected_output(a)


def test_decodes_and_prefill_chunks_share_a_step():
    s = make(num_blocks=32, block_size=4, budget=8)
    a, b = req("a", 4, max_tokens=10), req("b", 20, max_tokens=2)
    s.add_request(a)
    assert plan(step(s)) == [("a", 0, 4, True)]
    s.add_request(b)
    assert plan(step(s)) == [("a", 4, 1, True), ("b", 0, 7, False)]
    assert plan(step(s)) == [("a", 5, 1, True), ("b", 7, 7, False)]
    assert plan(step(s)) == [("a", 6, 1, True), ("b", 14, 6, True)]
    assert plan(step(s)) == [("a", 7, 1, True), ("b", 20, 1, True)]
    assert b.is_finished and b.output_token_ids == expected_output(b)
    run_to_end(s)
    assert a.output_token_ids == expected_output(a)


def test_waiting_requests_are_admitted_fcfs():
    # 6 blocks of 4 tokens. "big" cannot be admitted while "a" holds 3 blocks,
    # and "small" (which would fit) must not jump the queue.
    s = make(num_blocks=6, block_size=4, budget=64)
    a = req("a", 12, max_tokens=2)
    big, small = req("big", 16, max_tokens=1), req("small", 2, max_tokens=1)
    s.add_request(a)
    assert plan(step(s)) == [("a", 0, 12, True)]
    assert kv(s).block_table("a") == [0, 1, 2]
    s.add_request(big)
    s.add_request(small)
    out = step(s)  # a finishes; big needs 4 blocks but only 2 are free (a needs one more)
    assert plan(out) == [("a", 12, 1, True)]
    assert a.is_finished and [r.request_id for r in s.waiting] == ["big", "small"]
    out = step(s)
    assert plan(out) == [("big", 0, 16, True), ("small", 0, 2, True)]
    # big gets the never-used blocks first, then a's freed chain from its tail
    assert out.seqs[0].block_table == [4, 5, 3, 2] and out.seqs[1].block_table == [1]
    assert big.is_finished and small.is_finished
    assert kv(s).pool.num_used == 0


def test_admission_order_equals_arrival_order():
    s = make(num_blocks=64, budget=5, max_seqs=8)
    ids = [f"r{i}" for i in range(6)]
    for rid in ids:
        s.add_request(req(rid, 3, max_tokens=1))
    first_seen: list[str] = []
    for o in run_to_end(s):
        for q in o.seqs:
            if q.request_id not in first_seen:
                first_seen.append(q.request_id)
    assert first_seen == ids


# ------------------------------------------------------------------------- preemption
def test_preemption_of_the_newest_running_request():
    s = make(num_blocks=6, block_size=4, budget=64)
    a, b = req("a", 8, max_tokens=8), req("b", 8, max_tokens=6)
    s.add_request(a)
    s.add_request(b)
    out = step(s)
    assert plan(out) == [("a", 0, 8, True), ("b", 0, 8, True)]
    assert kv(s).block_table("a") == [0, 1] and kv(s).block_table("b") == [2, 3]
    out = step(s)  # token 9 of each needs a third block
    assert kv(s).block_table("a") == [0, 1, 4] and kv(s).block_table("b") == [2, 3, 5]
    assert kv(s).pool.num_free == 0
    for _ in range(3):  # positions 9, 10, 11 still fit
        out = step(s)
        assert plan(out) == [("a", a.num_computed_tokens - 1, 1, True), ("b", b.num_computed_tokens - 1, 1, True)]
        assert out.preempted_ids == []
    assert a.num_tokens == b.num_tokens == 13
    b_generated = list(b.output_token_ids)
    assert len(b_generated) == 5

    out = step(s)  # a needs a 4th block: b (the newest) is preempted
    assert out.preempted_ids == ["b"]
    assert plan(out) == [("a", 12, 1, True)]
    assert kv(s).block_table("a") == [0, 1, 4, 5]  # b's tail block, freed first, is reused first
    assert not kv(s).holds("b")
    assert b.status == Status.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert b.output_token_ids == b_generated  # generated tokens are kept, only recomputed
    assert list(s.waiting) == [b] and s.running == [a]
    assert s.num_preemptions == 1
    assert kv(s).pool.num_free == 2  # blocks 3 and 2

    # b needs 4 blocks to recompute its 13 tokens; it waits until a finishes.
    assert plan(step(s)) == [("a", 13, 1, True)]
    assert plan(step(s)) == [("a", 14, 1, True)]
    assert a.is_finished and a.output_token_ids == expected_output(a)
    out = step(s)
    assert plan(out) == [("b", 0, 13, True)]
    assert out.seqs[0].token_ids == b.prompt_token_ids + b_generated
    assert out.seqs[0].num_generated == 5
    run_to_end(s)
    assert b.is_finished and b.finish_reason == "length"
    # the same tokens as without preemption, none lost or duplicated
    assert b.output_token_ids == expected_output(b)
    assert kv(s).pool.num_used == 0


def test_preemption_puts_the_victim_at_the_front_of_the_queue():
    s = make(num_blocks=4, block_size=4, budget=64, max_seqs=8)
    a, b, c = req("a", 3, max_tokens=8), req("b", 3, max_tokens=8), req("c", 8, max_tokens=2)
    s.add_request(a)
    s.add_request(b)
    step(s)
    assert kv(s).block_table("a") == [0] and kv(s).block_table("b") == [1]
    s.add_request(c)  # c fits in the two free blocks
    out = step(s)
    assert plan(out) == [("a", 3, 1, True), ("b", 3, 1, True), ("c", 0, 8, True)]
    assert kv(s).pool.num_free == 0
    d = req("d", 2, max_tokens=1)
    s.add_request(d)  # waits: no free block
    out = step(s)  # a needs another block: c, the newest, goes first
    assert out.preempted_ids == ["c"]
    assert [q.request_id for q in out.seqs] == ["a", "b"]  # nobody is admitted in a preempting step
    assert kv(s).block_table("a") == [0, 3] and kv(s).block_table("b") == [1, 2]
    assert list(s.waiting) == [c, d] and c.num_computed_tokens == 0
    assert c.status == Status.PREEMPTED and d.status == Status.WAITING
    run_to_end(s)
    for r in (a, b, c, d):
        assert r.is_finished and r.output_token_ids == expected_output(r)


def test_a_request_preempts_itself_when_it_is_the_newest():
    s = make(num_blocks=3, block_size=4, budget=64)
    a, b = req("a", 6, max_tokens=3), req("b", 4, max_tokens=3)
    s.add_request(a)
    s.add_request(b)
    assert plan(step(s)) == [("a", 0, 6, True), ("b", 0, 4, True)]
    assert kv(s).block_table("a") == [0, 1] and kv(s).block_table("b") == [2]
    out = step(s)  # a still fits in its blocks; b needs a 2nd block and is itself the newest
    assert out.preempted_ids == ["b"] and plan(out) == [("a", 6, 1, True)]
    assert b.status == Status.PREEMPTED and not kv(s).holds("b") and b.output_token_ids == [fake_token("b", 4)]
    assert plan(step(s)) == [("a", 7, 1, True)]  # b needs 2 blocks, only 1 is free
    assert a.is_finished
    out = step(s)
    assert plan(out) == [("b", 0, 5, True)]
    assert out.seqs[0].block_table == [2, 1]  # free list: b's block, then a's chain tail first
    run_to_end(s)
    assert a.output_token_ids == expected_output(a)
    assert b.output_token_ids == expected_output(b)
    assert (a.num_preemptions, b.num_preemptions) == (0, 1)
    assert kv(s).pool.num_used == 0


def test_many_requests_with_preemption_finish_with_the_same_tokens():
    s = make(num_blocks=10, block_size=4, budget=12, max_seqs=5)
    reqs = [req(f"r{i}", 3 + (7 * i) % 17, max_tokens=3 + (5 * i) % 11) for i in range(12)]
    for r in reqs:
        s.add_request(r)
    run_to_end(s, max_steps=2000)
    assert s.num_preemptions > 0
    for r in reqs:
        assert r.is_finished and r.finish_reason == "length"
        assert r.output_token_ids == expected_output(r), r.request_id
    assert kv(s).pool.num_used == 0


# ------------------------------------------------------------------------------ abort
def test_abort_waiting_request():
    s = make(num_blocks=8, budget=8)
    a, b = req("a", 8, max_tokens=4), req("b", 8, max_tokens=4)
    s.add_request(a)
    s.add_request(b)
    step(s)  # a takes the whole budget, b waits
    assert list(s.waiting) == [b]
    assert s.finish("b", "abort") is b
    assert b.is_finished and b.finish_reason == "abort" and b.finished_time is not None
    assert s.num_waiting == 0 and "b" not in s.requests
    assert s.finish("b", "abort") is None  # unknown now
    s.check_invariants()
    out = step(s)
    assert out.finished_ids == ["b"] and plan(out) == [("a", 8, 1, True)]


def test_abort_running_request_frees_its_blocks():
    s = make(num_blocks=8, block_size=4, budget=64)
    a, b = req("a", 9, max_tokens=20), req("b", 4, max_tokens=20)
    s.add_request(a)
    s.add_request(b)
    step(s)
    assert kv(s).block_table("a") == [0, 1, 2] and kv(s).block_table("b") == [3]
    s.finish("a", "abort")
    s.check_invariants()
    assert a.is_finished and a.finish_reason == "abort"
    assert not kv(s).holds("a") and s.running == [b]
    assert kv(s).pool.num_used == 1
    out = step(s)
    assert out.finished_ids == ["a"] and plan(out) == [("b", 4, 1, True)]
    assert kv(s).block_table("b") == [3, 4]
    s.finish("b", "abort")
    s.check_invariants()
    assert kv(s).pool.num_used == 0 and not s.has_unfinished()
    # a's chain was freed tail first, then b's: reuse follows that order
    c = req("c", 32, max_tokens=1)
    s.add_request(c)
    assert step(s).seqs[0].block_table == [5, 6, 7, 2, 1, 0, 4, 3]


def test_abort_of_a_preempted_request():
    s = make(num_blocks=4, block_size=4, budget=64)
    a, b = req("a", 4, max_tokens=8), req("b", 11, max_tokens=2)
    s.add_request(a)
    s.add_request(b)
    step(s)
    out = step(s)
    assert out.preempted_ids == ["b"] and b.status == Status.PREEMPTED
    s.finish("b", "abort")
    s.check_invariants()
    assert b.finish_reason == "abort" and s.num_waiting == 0
    run_to_end(s)
    assert a.output_token_ids == expected_output(a)
    assert kv(s).pool.num_used == 0


# ------------------------------------------------------------------------- stop checks
def test_eos_and_stop_token_ids_finish_early():
    s = make(num_blocks=16, budget=64)
    stop_tok = fake_token("s", 6)
    eos_tok = fake_token("e", 7)
    r_stop = req("s", 5, max_tokens=10, stop_token_ids=[stop_tok])
    r_eos = Request("e", prompt_of("e", 5), SamplingParams(temperature=0, max_tokens=10),
                    eos_token_ids=frozenset({eos_tok}))
    r_ign = Request("i", prompt_of("e", 5), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                    eos_token_ids=frozenset({fake_token("i", 6)}))
    for r in (r_stop, r_eos, r_ign):
        s.add_request(r)
    run_to_end(s)
    assert r_stop.output_token_ids == [fake_token("s", 5), stop_tok]
    assert (r_stop.finish_reason, r_stop.stop_reason) == ("stop", stop_tok)
    assert r_eos.output_token_ids == [fake_token("e", 5), fake_token("e", 6), eos_tok]
    assert (r_eos.finish_reason, r_eos.stop_reason) == ("stop", None)
    assert r_ign.output_token_ids == expected_output(r_ign) and r_ign.finish_reason == "length"


# ------------------------------------------------------------ fairness between client calls
def grouped(group: str, count: int, n_prompt: int = 3, max_tokens: int = 4) -> list[Request]:
    """``count`` sequences of one client call (as the server adds prompts x n)."""
    return [Request(f"{group}-{i}", prompt_of(f"{group}-{i}", n_prompt),
                    SamplingParams(temperature=0, max_tokens=max_tokens), group=group) for i in range(count)]


def test_waiting_calls_take_turns():
    # 2 slots, two calls of 4 sequences each: FCFS would run all of A before B.
    s = make(num_blocks=64, budget=64, max_seqs=2)
    a, b = grouped("A", 4, max_tokens=1), grouped("B", 4, max_tokens=1)
    for r in a + b:
        s.add_request(r)
    admitted = [[q.request_id for q in step(s).seqs] for _ in range(4)]
    assert admitted == [["A-0", "B-0"], ["A-1", "B-1"], ["A-2", "B-2"], ["A-3", "B-3"]]
    assert s.num_preemptions == 0 and not s.has_unfinished()


def test_a_call_holding_every_slot_gives_slots_back_down_to_half():
    # Long decodes of one call fill all 4 slots; a newcomer must not wait for them to end.
    s = make(num_blocks=64, budget=64, max_seqs=4)
    big = grouped("big", 8, max_tokens=40)
    for r in big:
        s.add_request(r)
    step(s)
    assert [r.request_id for r in s.running] == ["big-0", "big-1", "big-2", "big-3"]
    small = req("small", 3, max_tokens=2)
    s.add_request(small)
    out = step(s)  # the newest sequence of the big call is preempted, small runs in the same step
    assert out.preempted_ids == ["big-3"] and big[3].status == Status.PREEMPTED
    assert [q.request_id for q in out.seqs] == ["big-0", "big-1", "big-2", "small"]
    out = step(s)
    assert small.is_finished and small.output_token_ids == expected_output(small)
    assert [r.request_id for r in s.running] == ["big-0", "big-1", "big-2"]
    others = [req("x", 3, max_tokens=30), req("y", 3, max_tokens=30), req("z", 3, max_tokens=30)]
    for r in others:
        s.add_request(r)
    out = step(s)  # a free slot: the first newcomer takes it, nobody is preempted
    assert out.preempted_ids == [] and [r.request_id for r in s.running][-1] == "x"
    out = step(s)  # big holds 3 of 4: it gives one back, down to half, and no further
    assert out.preempted_ids == ["big-2"] and [r.request_id for r in s.running][-1] == "y"
    out = step(s)
    assert out.preempted_ids == [] and is_waiting(s, others[2])
    run_to_end(s)
    for r in big + others:
        assert r.is_finished and r.output_token_ids == expected_output(r), r.request_id
    assert kv(s).pool.num_used == 0


def is_waiting(s: Scheduler, r: Request) -> bool:
    return r in s.waiting and r.status == Status.WAITING


def test_calls_within_half_the_slots_are_never_preempted_for_fairness():
    # An offline batch: many calls of 2 sequences each, 4 slots; nobody holds more than half.
    s = make(num_blocks=64, budget=64, max_seqs=4)
    calls = [grouped(f"c{i}", 2, max_tokens=6) for i in range(6)]
    for call in calls:
        for r in call:
            s.add_request(r)
    run_to_end(s)
    assert s.num_preemptions == 0
    for call in calls:
        for r in call:
            assert r.output_token_ids == expected_output(r)


@pytest.mark.slow
def test_admission_looks_at_a_bounded_number_of_waiting_requests(monkeypatch):
    from hyprefix import scheduler as scheduler_module

    s = make(num_blocks=4096, block_size=4, budget=64, max_seqs=2, caching=True)
    shared = prompt_of("shared", 40)
    for i in range(3000):  # one call: 3,000 samples of a 40-token prompt; all but one wait for its blocks
        s.add_request(Request(f"r{i}", shared, SamplingParams(temperature=0, max_tokens=1), group="fanout"))
    looked = []
    match = kv(s).match_prefix
    monkeypatch.setattr(kv(s), "match_prefix", lambda r: looked.append(r.request_id) or match(r))
    step(s)
    limit = max(scheduler_module.SCAN_MIN, scheduler_module.SCAN_PER_SEQ * 2)
    assert 0 < len(looked) <= limit
    run_to_end(s, max_steps=5000)
    assert kv(s).pool.num_used == 0


def test_aborting_queued_and_running_sequences_compares_no_requests(monkeypatch):
    s = make(num_blocks=64, budget=16, max_seqs=8)
    reqs = grouped("fanout", 4096, max_tokens=8)
    for r in reqs:
        s.add_request(r)
    step(s)
    comparisons = []

    def counting_eq(self, other):
        comparisons.append(1)
        return self is other

    monkeypatch.setattr(Request, "__eq__", counting_eq)
    for r in reversed(reqs):  # the newest first: every one is deep in the queue
        s.finish(r.request_id, "abort")
    # A deque would compare each aborted request with the ones before it (~8M times);
    # only the running list (max_num_seqs long) is scanned now.
    assert len(comparisons) <= 8 * 8
    s.check_invariants()
    assert not s.has_unfinished() and kv(s).pool.num_used == 0


# ------------------------------------------------------------------- structured outputs
class RecordingGrammar:
    """A stand-in for ``structured.grammar.Grammar`` that records what advances it."""

    masks_first = False

    def __init__(self) -> None:
        self.accepted: list[int] = []

    def accept(self, token_id: int) -> bool:
        self.accepted.append(token_id)
        return True


def test_the_scheduler_advances_grammars_by_each_appended_token_in_order():
    """``Scheduler.update`` is where a grammar advances: by every sampled token appended to its
    request, in order, none for a prefill chunk that samples nothing; the step's rows carry
    no grammar (the runner reads a step's masks, ``structured/step_masks.py``)."""
    s = make(num_blocks=32, budget=8)
    a, b = req("a", 10, max_tokens=3), req("b", 3, max_tokens=2)
    a.grammar = RecordingGrammar()
    s.add_request(a)
    s.add_request(b)
    out = step(s)
    assert plan(out) == [("a", 0, 8, False)]  # a chunk: nothing sampled, nothing accepted
    assert a.grammar.accepted == [] and not hasattr(out.seqs[0], "grammar")
    run_to_end(s)
    assert a.output_token_ids == expected_output(a)
    assert a.grammar.accepted == a.output_token_ids
    assert b.output_token_ids == expected_output(b) and b.grammar is None
