"""Continuous-batching step planner (plain data in, plain data out; no torch).

Each step has a token budget (``max_num_batched_tokens``) and a request cap
(``max_num_seqs``). Running requests (decodes and unfinished prefill chunks) are
served first, in admission order, then waiting requests in the order of the scheduling
policy (``scheduling_policy.py``, ``--scheduling-policy``): by default FCFS within a group
(one client call), round-robin between groups, groups with fewer running requests first
(``wait_queue.py``); ``priority`` admits by (priority, arrival) and keeps running requests
in that order; ``cache-aware`` admits the requests with the most cached tokens first, but a
request that has waited ``SchedulerConfig.max_wait_s`` (``--scheduling-max-wait-s``, default
3 s) goes before every one that has not, so none waits more than about that bound beyond
its FCFS turn (under ``priority`` such a request is promoted above every priority; default
60 s). Long prompts are prefilled in chunks that fit the budget. When the KV pool
runs out, the last running request (the newest; under ``priority`` the lowest priority) is
preempted: its blocks are freed and it is recomputed later (prompt plus the tokens it
already generated), so nothing crashes. When every slot is taken and a group waits with
nothing running, a group holding more than half the slots gives back its newest one the
same way, so one big call cannot hold the engine for everyone (where the policy would admit
the waiting group first: under ``priority`` one of no lower priority, under ``cache-aware``
one that has waited the bound).

Per step, admission looks at no more than ``max(SCAN_MIN, SCAN_PER_SEQ *
max_num_seqs)`` waiting requests, so a queue of thousands costs no more than a
short one; aborting a waiting or running request touches nothing else.

With prefix caching, admission takes the longest cached prefix (skipped, not
counted against the budget), requests wait for blocks a running sibling is
computing, and blocks are published after the step that completed them. Every
cache question goes to the ``CacheCoordinator``, whatever kinds of layers the
model has (attention, recurrent state or both). A request that asked for it
(``SamplingParams.cache_ttl_s``) keeps its prefix a while when it finishes, evicted after every
other cached block (``cache/retention.py``); retentions expire at the start of each step.

With speculative decoding (``speculative.py``), a decoding request's step also carries the
tokens its context predicts (drafts): one row of 1 + k tokens. ``update`` takes the tokens the
runner accepted, advances ``num_computed_tokens`` by them only (rejected drafts' K/V is
overwritten later and never published) and then publishes complete blocks.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from hyprefix.cache.coordinator import DISK_WAIT, CacheCoordinator, StateOp
from hyprefix.cache.retention import RetentionConfig
from hyprefix.outputs import RetentionGrant, ScheduledSeq, SchedulerOutput
from hyprefix.request import Request, Status
from hyprefix.scheduling_policy import FCFS, make_policy
from hyprefix.speculative import DraftState, NgramIndex, SpecStats, SpeculativeConfig
from hyprefix.wait_queue import WaitQueue

SCAN_MIN = 256
SCAN_PER_SEQ = 4


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int
    max_num_seqs: int
    speculative: SpeculativeConfig | None = None
    # Rows a step may verify drafts in (None: any; hybrids keep the state after every draft
    # position in scratch slots, a set of them per row)
    max_draft_rows: int | None = None
    # Hybrids: a row's drafts stop before the next block boundary, so no state checkpoint is
    # ever due inside drafts (its key would name tokens not yet accepted)
    drafts_within_block: bool = False
    # scheduling_policy.py: "fcfs", "priority" or "cache-aware" (vLLM's SchedulerConfig.policy)
    policy: str = FCFS
    # the aging bound: a request that has waited this many seconds goes before every cache-preferred
    # one (cache-aware) or every priority (priority); None: the policy's default
    max_wait_s: float | None = None
    # priority: the most urgent priority a request gets (``grant_priority``); None: any
    highest_priority: int | None = None
    # finished requests' prefixes kept a while (``SamplingParams.cache_ttl_s``; cache/retention.py)
    retention: RetentionConfig = field(default_factory=RetentionConfig)


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: CacheCoordinator,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.cache = cache
        self.clock = clock  # wall-clock seconds, as ``Request.arrival_time`` (tests inject their own)
        self.policy = make_policy(config.policy, config.max_wait_s)
        cache.retention.configure(config.retention)
        self.waiting: WaitQueue = self.policy.new_queue()
        self.running: list[Request] = []  # in admission order (priority: by (priority, arrival))
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
        self.spec_stats = SpecStats()

    # ----------------------------------------------------------------- intake
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.policy.arrived(request, self.waiting, self._running_in_group)
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
        # (request, tokens to compute, write their K/V, drafts among them)
        planned: list[tuple[Request, int, bool, list[int]]] = []
        preempted: list[str] = []
        state_ops: list[StateOp] = []
        now = self.clock()
        self.cache.retention.expire(now)
        fairness_preempted = self._preempt_for_fairness(now)

        i = 0
        draft_rows = self.config.max_draft_rows
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            drafts = self._drafts(request, budget) if draft_rows is None or draft_rows > 0 else []
            if drafts and self.cache.allocate_slots(request, request.num_tokens + len(drafts)):
                planned.append((request, 1 + len(drafts), True, drafts))
                budget -= 1 + len(drafts)
                draft_rows = None if draft_rows is None else draft_rows - 1
                i += 1
                continue
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.cache.allocate_slots(request, request.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                planned.append((request, n, True, []))
                budget -= n
                i += 1

        if not preempted:
            budget = self._admit_waiting(planned, budget, now, state_ops)
        preempted = fairness_preempted + preempted

        seqs = [self._seq(request, n, write, drafts) for request, n, write, drafts in planned]
        finished, self._finished_since_schedule = self._finished_since_schedule, []
        return SchedulerOutput(
            seqs=seqs,
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            preempted_ids=preempted,
            finished_ids=finished,
            state_ops=state_ops,
        )

    def _drafts(self, request: Request, budget: int) -> list[int]:
        """The tokens a decoding request's context predicts (``speculative.py``), as many as its
        limits allow: ``max_tokens`` (every draft accepted still leaves room for the token the
        verification samples), the step's budget, and for hybrids the next block boundary."""
        spec = self.config.speculative
        if spec is None or not request.output_token_ids or request.grammar is not None \
                or request.num_computed_tokens != request.num_tokens - 1:
            return []
        k = min(spec.k, request.params.max_tokens - len(request.output_token_ids) - 1, budget - 1)
        if self.config.drafts_within_block:
            bs = self.cache.block_size
            k = min(k, (request.num_computed_tokens // bs + 1) * bs - request.num_computed_tokens - 2)
        if k <= 0:
            return []
        state = request.drafting
        if state is None:
            state = request.drafting = DraftState(NgramIndex(spec.prompt_lookup_min, spec.prompt_lookup_max))
        return state.propose(state.context(request.prompt_token_ids, request.output_token_ids), k)

    def _admit_waiting(self, planned: list[tuple[Request, int, bool, list[int]]], budget: int, now: float,
                       state_ops: list[StateOp]) -> int:
        """Admit waiting requests in the policy's order; returns the budget left.

        A request takes its longest cached prefix first; only the rest counts
        against the budget. A request whose next block another running request is
        computing right now waits (without holding up the requests behind it). The
        first request that does not fit in the KV pool stops admission, so later
        requests cannot starve it.
        """
        admitted: list[Request] = []
        blocked = False
        scan = max(SCAN_MIN, SCAN_PER_SEQ * self.config.max_num_seqs)
        if budget > 0 and len(self.running) < self.config.max_num_seqs:
            order = self.policy.admission_order(self.waiting, self.running, self._running_in_group, scan, now,
                                                self.cache.cached_tokens)
        else:  # nobody is admitted: the waiting only learn where they branch off (any order does)
            order = self.waiting.in_turn(self._running_in_group.__getitem__)
        for request in itertools.islice(order, scan):
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
            planned.append((request, n, hit.write_kv, []))
            budget -= n
        for request in admitted:
            self.waiting.remove(request)
        self.policy.admitted(len(admitted), now)
        return budget

    def _run(self, request: Request) -> None:
        if self.policy.running_key is None:
            self.running.append(request)
        else:  # after its equals: the last one is preempted first
            bisect.insort(self.running, request, key=self.policy.running_key)
        self._running_in_group[request.group_id] += 1

    def _stop_running(self, request: Request) -> None:
        self.running.remove(request)  # identity (Request has eq=False); at most max_num_seqs entries
        group = request.group_id
        self._running_in_group[group] -= 1
        if not self._running_in_group[group]:
            del self._running_in_group[group]

    def _preempt_for_fairness(self, now: float) -> list[str]:
        """While every slot is taken and groups wait with nothing running (and not waiting
        on a sibling's blocks), the group holding the most slots, if more than half,
        gives back its newest requests (the last in running order): one per such group
        whose head the policy would admit before that request, down to half."""
        if len(self.running) < self.config.max_num_seqs or not self.waiting:
            return []
        big, held = max(self._running_in_group.items(), key=lambda item: item[1])
        excess = held - self.config.max_num_seqs // 2
        if excess <= 0:
            return []
        candidates = [r for r in reversed(self.running) if r.group_id == big][:excess]
        victims: list[Request] = []
        for group in self.waiting.groups():
            head = self.waiting.head(group)
            if self._running_in_group[group] == 0 and head.waiting_on is None \
                    and self.policy.may_displace(head, candidates[len(victims)], now):
                victims.append(candidates[len(victims)])
                if len(victims) == excess:
                    break
        for victim in victims:
            self._preempt(victim)
        return [victim.request_id for victim in victims]

    def _seq(self, request: Request, n: int, write_kv: bool, drafts: list[int]) -> ScheduledSeq:
        start = request.num_computed_tokens
        cache = self.cache.plan_step(request, start, n)
        return ScheduledSeq(
            request_id=request.request_id,
            token_ids=request.tokens_in(start, start + n - len(drafts)) + drafts,
            start_pos=start,
            block_table=cache.block_table,
            sample=start + n - len(drafts) == request.num_tokens,
            num_drafts=len(drafts),
            params=request.params,
            num_generated=len(request.output_token_ids),
            write_kv=write_kv,
            state_slot=cache.state_slot,
            state_taps=cache.state_taps,
            window_first_block=cache.window_first_block,
            window_blocks=cache.window_blocks,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
        )

    def _preempt(self, request: Request) -> None:
        self._stop_running(request)
        self.cache.free(request)
        request.num_computed_tokens = 0
        request.waiting_on = None
        request.status = Status.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.policy.arrived(request, None, self._running_in_group)  # FCFS puts it first again
        self.waiting.appendleft(request)

    # ----------------------------------------------------------------- update
    def update(self, output: SchedulerOutput, sampled: Mapping[str, int | Sequence[int]]) -> list[Request]:
        """Advance requests by what the step computed; returns the requests that got new tokens
        (finished ones included, already freed), each with ``num_new_tokens`` set.

        ``sampled``: each sampling request's new token, or tokens: a row that verified drafts
        gets the drafts the runner accepted and the token sampled after them (1 to k + 1).
        A request with a structured-outputs grammar advances it by each token appended, in
        order (``_append``)."""
        now = self.clock()
        advanced: list[Request] = []
        for seq in output.seqs:
            request = self.requests.get(seq.request_id)
            if request is None or request.status != Status.RUNNING:
                continue
            if seq.num_drafts:
                self._verified(request, seq, sampled[seq.request_id])
                advanced.append(request)
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
            token = sampled[seq.request_id]
            self._append(request, token if isinstance(token, int) else token[0])
            request.num_new_tokens = 1
            if request.first_token_time is None:
                request.first_token_time = now
            if request.check_stop():
                self.finish(request.request_id, request.finish_reason or "stop")
            advanced.append(request)
        return advanced

    def _verified(self, request: Request, seq: ScheduledSeq, tokens: int | Sequence[int]) -> None:
        """A row that carried drafts: ``tokens`` are the accepted drafts and the token sampled
        after them. Appends them up to the first that stops the request, counts as computed the
        tokens whose K/V the step wrote and that stand (the row's first token and the accepted
        drafts among those kept), and only then publishes complete blocks."""
        tokens = [tokens] if isinstance(tokens, int) else list(tokens)
        assert 1 <= len(tokens) <= seq.num_drafts + 1, "a verification returns 1 to k + 1 tokens"
        accepted = len(tokens) - 1
        self.spec_stats.add(seq.num_drafts, accepted)
        if request.drafting is not None:
            request.drafting.verified(seq.num_drafts, accepted)
        stopped = False
        kept = 0
        for token in tokens:
            self._append(request, token)
            kept += 1
            if request.check_stop():
                stopped = True
                break
        request.num_new_tokens = kept
        request.num_computed_tokens += kept
        self.decode_tokens += kept
        self.cache.after_step(request)
        if stopped:
            self.finish(request.request_id, request.finish_reason or "stop")

    @staticmethod
    def _append(request: Request, token: int) -> None:
        """Append a sampled token to ``request`` and advance its structured-outputs grammar by
        it: the one place a grammar advances (the runner only reads a step's masks,
        ``structured/step_masks.py``). A token the grammar refuses leaves the parser in its
        error state, which ends the request (``OutputProcessor``)."""
        request.append_token(token)
        if request.grammar is not None:
            request.grammar.accept(token)

    def finish(self, request_id: str, reason: str) -> Request | None:
        """Finish (or abort, with reason "abort") a request and free its blocks at once; one that
        asked for it (``cache_ttl_s``) and was not aborted keeps its prefix a while first
        (``request.retention`` says what it got)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        now = self.clock()
        if request.status == Status.RUNNING:
            self._stop_running(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        ttl = request.params.cache_ttl_s
        if ttl is not None and reason != "abort":
            request.retention = self.cache.retention.retain(request, ttl, now) \
                if self.cache.holds(request_id) else RetentionGrant(0.0, 0)
        self.cache.free(request)
        request.status = Status.FINISHED
        request.finish_reason = reason
        request.finished_time = now
        self._finished_since_schedule.append(request_id)
        return request

    def release_retention(self, request_ids: Sequence[str]) -> int:
        """End the retentions of these finished requests now (``cache/retention.py``); returns how many."""
        return sum(self.cache.retention.release(request_id) for request_id in request_ids)

    # ------------------------------------------------------------- invariants
    def check_invariants(self) -> None:
        running = {r.request_id for r in self.running}
        self.cache.check_invariants(running)
        ids = [r.request_id for r in self.running] + [r.request_id for r in self.waiting]
        assert len(ids) == len(set(ids)) == len(self.requests), "request bookkeeping out of sync"
        assert len(self.running) <= self.config.max_num_seqs
        assert self._running_in_group == Counter(r.group_id for r in self.running), "group counts out of sync"
        self.policy.check_invariants(self.waiting, self.running)
        for request in self.waiting:
            assert not self.cache.holds(request.request_id), f"waiting {request.request_id} holds blocks"
            assert request.num_computed_tokens == 0
        for request in self.running:
            table = self.cache.block_table(request.request_id)
            assert len(table) * self.cache.block_size >= request.num_computed_tokens
