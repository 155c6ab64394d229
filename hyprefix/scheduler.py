"""Continuous-batching step planner (plain data in, plain data out; no torch).

Each step has a token budget (``max_num_batched_tokens``) and a request cap
(``max_num_seqs``). Running requests (decodes and unfinished prefill chunks) are
served first, in admission order, then waiting requests: FCFS within a group (one
client call), round-robin between groups, groups with fewer running requests first
(``wait_queue.py``). Long prompts are prefilled in chunks that fit the budget. When
the KV pool runs out, the newest running request is preempted: its blocks are freed
and it is recomputed later (prompt plus the tokens it already generated), so nothing
crashes. When every slot is taken and a group waits with nothing running, a group
holding more than half the slots gives back its newest one the same way, so one big
call cannot hold the engine for everyone.

Per step, admission looks at no more than ``max(SCAN_MIN, SCAN_PER_SEQ *
max_num_seqs)`` waiting requests, so a queue of thousands costs no more than a
short one; aborting a waiting or running request touches nothing else.

With prefix caching, admission takes the longest cached prefix (skipped, not
counted against the budget), requests wait for blocks a running sibling is
computing, and blocks are published after the step that completed them. Every
cache question goes to the ``CacheCoordinator``, whatever kinds of layers the
model has (attention, recurrent state or both).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

from hyprefix.cache.coordinator import DISK_WAIT, CacheCoordinator, StateOp
from hyprefix.outputs import ScheduledSeq, SchedulerOutput
from hyprefix.request import Request, Status
from hyprefix.wait_queue import WaitQueue

SCAN_MIN = 256
SCAN_PER_SEQ = 4


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int
    max_num_seqs: int


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: CacheCoordinator) -> None:
        self.config = config
        self.cache = cache
        self.waiting = WaitQueue()
        self.running: list[Request] = []  # in admission order
        self._running_in_group: Counter[str] = Counter()
        self.requests: dict[str, Request] = {}
        self._finished_since_schedule: list[str] = []
        self.num_preemptions = 0
        self.prefill_computed_tokens = 0
        self.prefill_skipped_tokens = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.decode_tokens = 0
        self.sibling_waits = 0

    # ----------------------------------------------------------------- intake
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def forget_unstarted_hashes(self) -> int:
        """Clear the block hashes of waiting requests that computed nothing yet (after the
        cache's model identity changed: they hash again from the new root, so they start
        under the new weights without a hit on the old ones). Returns how many."""
        cleared = 0
        for request in self.waiting:
            if request.num_computed_tokens == 0 and request.block_hashes:
                request.block_hashes.clear()
                cleared += 1
        return cleared

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # --------------------------------------------------------------- planning
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        planned: list[tuple[Request, int, bool]] = []  # (request, tokens to compute, write their K/V)
        preempted: list[str] = []
        state_ops: list[StateOp] = []
        now = time.time()
        fairness_preempted = self._preempt_for_fairness()

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.cache.allocate_slots(request, request.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                planned.append((request, n, True))
                budget -= n
                i += 1

        if not preempted:
            budget = self._admit_waiting(planned, budget, now, state_ops)
        preempted = fairness_preempted + preempted

        seqs = [self._seq(request, n, write) for request, n, write in planned]
        finished, self._finished_since_schedule = self._finished_since_schedule, []
        return SchedulerOutput(
            seqs=seqs,
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            preempted_ids=preempted,
            finished_ids=finished,
            state_ops=state_ops,
        )

    def _admit_waiting(self, planned: list[tuple[Request, int, bool]], budget: int, now: float,
                       state_ops: list[StateOp]) -> int:
        """Admit waiting requests FCFS; returns the budget left.

        A request takes its longest cached prefix first; only the rest counts
        against the budget. A request whose next block another running request is
        computing right now waits (without holding up the requests behind it). The
        first request that does not fit in the KV pool stops admission, so later
        requests cannot starve it.
        """
        admitted: list[Request] = []
        blocked = False
        scan = max(SCAN_MIN, SCAN_PER_SEQ * self.config.max_num_seqs)
        for request in self.waiting.in_turn(self._running_in_group.__getitem__):
            scan -= 1
            if scan < 0:
                break
            if blocked or budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                self.cache.note_waiting(request)  # it may branch off a prefill running now
                continue
            hit = self.cache.find_hit(request)
            if hit.wait_for is not None:
                if request.waiting_on != hit.wait_for:
                    request.waiting_on = hit.wait_for
                    if hit.wait_for != DISK_WAIT:  # a sibling computes the blocks (not a disk read)
                        self.sibling_waits += 1
                self.cache.note_waiting(request)
                continue
            request.waiting_on = None
            hit_tokens = hit.num_tokens  # a full hit still computes the last token (its logits are needed)
            n = min(request.num_tokens - hit_tokens, budget)
            ops = self.cache.admit(request, hit, hit_tokens + n)
            if ops is None:
                blocked = True
                continue
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += hit_tokens
            self.prefill_skipped_tokens += hit_tokens
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
                request.num_cached_tokens = hit_tokens
            request.num_computed_tokens = hit_tokens
            state_ops.extend(ops)
            request.status = Status.RUNNING
            admitted.append(request)
            self._run(request)
            planned.append((request, n, hit.write_kv))
            budget -= n
        for request in admitted:
            self.waiting.remove(request)
        return budget

    def _run(self, request: Request) -> None:
        self.running.append(request)
        self._running_in_group[request.group_id] += 1

    def _stop_running(self, request: Request) -> None:
        self.running.remove(request)  # identity (Request has eq=False); at most max_num_seqs entries
        group = request.group_id
        self._running_in_group[group] -= 1
        if not self._running_in_group[group]:
            del self._running_in_group[group]

    def _preempt_for_fairness(self) -> list[str]:
        """While every slot is taken and groups wait with nothing running (and not waiting
        on a sibling's blocks), the group holding the most slots, if more than half,
        gives back its newest requests: one per such group, down to half."""
        if len(self.running) < self.config.max_num_seqs or not self.waiting:
            return []
        big, held = max(self._running_in_group.items(), key=lambda item: item[1])
        excess = held - self.config.max_num_seqs // 2
        if excess <= 0:
            return []
        starving = 0
        for group in self.waiting.groups():
            if self._running_in_group[group] == 0 and self.waiting.head(group).waiting_on is None:
                starving += 1
                if starving == excess:
                    break
        victims = [r for r in reversed(self.running) if r.group_id == big][:starving]
        for victim in victims:
            self._preempt(victim)
        return [victim.request_id for victim in victims]

    def _seq(self, request: Request, n: int, write_kv: bool) -> ScheduledSeq:
        start = request.num_computed_tokens
        cache = self.cache.plan_step(request, start, n)
        return ScheduledSeq(
            request_id=request.request_id,
            token_ids=request.tokens_in(start, start + n),
            start_pos=start,
            block_table=cache.block_table,
            sample=start + n == request.num_tokens,
            params=request.params,
            num_generated=len(request.output_token_ids),
            write_kv=write_kv,
            state_slot=cache.state_slot,
            state_taps=cache.state_taps,
            window_first_block=cache.window_first_block,
            window_blocks=cache.window_blocks,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            grammar=request.grammar,
        )

    def _preempt(self, request: Request) -> None:
        self._stop_running(request)
        self.cache.free(request)
        request.num_computed_tokens = 0
        request.waiting_on = None
        request.status = Status.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ----------------------------------------------------------------- update
    def update(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance requests by what the step computed; returns the requests that got a
        new token (finished ones included, already freed)."""
        now = time.time()
        advanced: list[Request] = []
        for seq in output.seqs:
            request = self.requests.get(seq.request_id)
            if request is None or request.status != Status.RUNNING:
                continue
            # A decode computes the one token sampled last step; everything else
            # (prompt chunks, recomputation after preemption) is prefill work.
            if seq.num_tokens == 1 and request.output_token_ids and seq.start_pos == request.num_tokens - 1:
                self.decode_tokens += 1
            else:
                self.prefill_computed_tokens += seq.num_tokens
            request.num_computed_tokens += seq.num_tokens
            self.cache.after_step(request)
            if not seq.sample:
                continue
            request.append_token(sampled[seq.request_id])
            if request.first_token_time is None:
                request.first_token_time = now
            if request.check_stop():
                self.finish(request.request_id, request.finish_reason or "stop")
            advanced.append(request)
        return advanced

    def finish(self, request_id: str, reason: str) -> Request | None:
        """Finish (or abort, with reason "abort") a request and free its blocks at once."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == Status.RUNNING:
            self._stop_running(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.cache.free(request)
        request.status = Status.FINISHED
        request.finish_reason = reason
        request.finished_time = time.time()
        self._finished_since_schedule.append(request_id)
        return request

    # ------------------------------------------------------------- invariants
    def check_invariants(self) -> None:
        running = {r.request_id for r in self.running}
        self.cache.check_invariants(running)
        ids = [r.request_id for r in self.running] + [r.request_id for r in self.waiting]
        assert len(ids) == len(set(ids)) == len(self.requests), "request bookkeeping out of sync"
        assert len(self.running) <= self.config.max_num_seqs
        assert self._running_in_group == Counter(r.group_id for r in self.running), "group counts out of sync"
        for request in self.waiting:
            assert not self.cache.holds(request.request_id), f"waiting {request.request_id} holds blocks"
            assert request.num_computed_tokens == 0
        for request in self.running:
            table = self.cache.block_table(request.request_id)
            assert len(table) * self.cache.block_size >= request.num_computed_tokens
