"""Scheduling policies: the order in which the scheduler admits waiting requests, and whom it
preempts first (plain data, no torch). ``--scheduling-policy`` takes vLLM's and SGLang's names:

- ``fcfs`` (the default): first come, first served within a group (one client call),
  round-robin between groups, groups with fewer running requests first (``wait_queue.py``).
- ``priority`` (vLLM's): every request has a ``priority`` (an integer, default 0; lower is
  served earlier). Waiting requests are admitted in (priority, arrival) order, and running
  requests are kept in that order, so when the KV pool runs out the request preempted is the
  lowest-priority one (the largest value; the latest arrival among equals) and the highest
  ones get the step's budget first. With aging (vLLM has none, so there a stream of
  higher-priority requests keeps lower ones waiting indefinitely): a request that has waited
  ``max_wait_s`` (``--scheduling-max-wait-s``, default ``DEFAULT_PRIORITY_MAX_WAIT_S``) since it
  arrived is promoted for good (``Request.aged``): it ranks above every priority, first come
  first served among the promoted, both waiting and running (so it is not the next preemption
  victim either). ``highest_priority`` (``--highest-request-priority``) caps what a request
  may claim: a lower value is granted as that one (``grant_priority``), and the server's
  response says what was granted.
- ``cache-aware``: the waiting requests admission looks at are ranked by how many of their
  tokens the cache holds now (``CacheCoordinator.cached_tokens``: nothing allocated, no LRU
  moved), most first (SGLang's longest-prefix-match), with aging: a request that has waited
  ``max_wait_s`` (``--scheduling-max-wait-s``, default ``DEFAULT_MAX_WAIT_S``) or longer past
  its FCFS turn goes before every request that has not, in FCFS order among themselves. Its
  FCFS turn is when first come, first served would have admitted it: once the scheduler has
  admitted as many requests since it arrived as ``fcfs``'s order had ahead of it then
  (``WaitQueue.ahead_of_new``; a preempted request's turn is at once). So no request waits
  more than about ``max_wait_s`` beyond where FCFS would have admitted it: once aged, only
  older aged ones go before it. Counting from arrival instead would, in a burst longer than
  the bound, age every request and serve the whole burst FCFS.

Fair shares (``priority`` and ``cache-aware``): among waiting requests of equal rank (the same
priority; the same cached tokens; or both aged), tenants with fewer running requests go first,
round-robin between tenants, first come first served within one (``fair_turns``). A request's
tenant is ``Request.tenant`` (the API key's tenant a server bound to its cache salt, or the
salt) or, without one, its group, so requests without a salt share as ``fcfs``'s groups do.

Every policy keeps the scheduler's other rules: admission looks at no more waiting requests
than the scan limit (under ``cache-aware`` the first ones of the FCFS order, ranked; under
``priority`` the first ones of the (priority, arrival) order); a request waiting on a
sibling's blocks is skipped; the first one that does not fit in the KV pool stops admission.
The fairness preemption (``Scheduler._preempt_for_fairness``) frees a slot for a starving
group only where the policy admits that group's head before the request it would preempt
(``may_displace``), so nothing is preempted only to be admitted again. A non-zero
``priority`` under another policy is refused (``check_priority``: a 400 at the server), as
vLLM refuses it.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

from hyprefix.errors import RequestError
from hyprefix.request import Request
from hyprefix.sampling import MIN_PRIORITY
from hyprefix.wait_queue import WaitQueue

FCFS, PRIORITY, CACHE_AWARE = "fcfs", "priority", "cache-aware"
POLICIES = (FCFS, PRIORITY, CACHE_AWARE)
# cache-aware: seconds a request waits before it goes ahead of every cache-preferred one
DEFAULT_MAX_WAIT_S = 3.0
# priority: seconds a request waits before it is promoted above every priority (longer than
# cache-aware's: a priority is a promise to the client, a cache preference only a speed-up)
DEFAULT_PRIORITY_MAX_WAIT_S = 60.0
AGED_RANK = MIN_PRIORITY - 1  # the rank of a promoted request: before every priority

FairKey = tuple[str, str]  # ("tenant", name) or ("group", group id)


def check_priority(policy: str, priority: int) -> None:
    """Refuse a non-zero ``priority`` unless the engine schedules by priority (vLLM's rule)."""
    if priority != 0 and policy != PRIORITY:
        raise RequestError(f"priority {priority} needs --scheduling-policy priority (this engine's policy is "
                           f"{policy}): send 0 or leave it out", param="priority")


def default_max_wait_s(policy: str) -> float:
    """``--scheduling-max-wait-s``'s default under ``policy``."""
    return DEFAULT_PRIORITY_MAX_WAIT_S if policy == PRIORITY else DEFAULT_MAX_WAIT_S


def grant_priority(priority: int, highest: int | None) -> int:
    """The priority a request asking for ``priority`` gets: at most as urgent as ``highest``
    (the lowest value allowed; None: any)."""
    return priority if highest is None else max(priority, highest)


def priority_rank(request: Request) -> int:
    """Where the priority policy ranks a request: its priority, or before all once aged."""
    return AGED_RANK if request.aged else request.priority


def fair_key(request: Request) -> FairKey:
    tenant = request.tenant
    return ("group", request.group_id) if tenant is None else ("tenant", tenant)


def running_by_tenant(running: Iterable[Request]) -> Counter[FairKey]:
    return Counter(fair_key(request) for request in running)


def fair_turns(requests: Sequence[Request], running: Mapping[FairKey, int]) -> list[Request]:
    """``requests`` (equals, in FCFS order) in turns: the first of every tenant, then the
    second of every tenant, ...; tenants with fewer ``running`` requests first, ties in the
    order they first appear. O(len(requests))."""
    by_key: dict[FairKey, list[Request]] = {}
    for request in requests:
        by_key.setdefault(fair_key(request), []).append(request)
    if len(by_key) <= 1:
        return list(requests)
    queues = sorted(by_key.items(), key=lambda item: running.get(item[0], 0))
    turns: list[Request] = []
    cursors = [iter(queue) for _, queue in queues]
    while cursors:
        alive = []
        for cursor in cursors:
            request = next(cursor, None)
            if request is not None:
                turns.append(request)
                alive.append(cursor)
        cursors = alive
    return turns


class PriorityWaitQueue(WaitQueue):
    """The waiting requests in (rank, arrival) order (``priority_rank``) as well as by group
    (the groups' queues keep membership, the groups' heads the fairness preemption reads, and
    plain iteration), and the ones not yet aged in arrival order (``promote`` takes a prefix
    of it). Adding or removing is a binary search and a list insertion or deletion; nothing
    compares requests (every entry's key ends with a number of its own)."""

    def __init__(self) -> None:
        super().__init__()
        self._order: list[tuple[int, float, int, Request]] = []
        self._places: dict[str, tuple[int, float, int]] = {}  # request id -> its key in ``_order``
        self._young: list[tuple[float, int, Request]] = []  # not aged, by (arrival, seq)
        self._seq = itertools.count()

    def _add(self, request: Request) -> None:
        super()._add(request)
        seq = next(self._seq)
        self._insert(request, seq)
        if not request.aged:
            bisect.insort(self._young, (request.arrival_time, seq, request))

    def _insert(self, request: Request, seq: int) -> None:
        place = (priority_rank(request), request.arrival_time, seq)
        self._places[request.request_id] = place
        bisect.insort(self._order, (*place, request))

    def _delete(self, request: Request) -> tuple[int, float, int]:
        place = self._places.pop(request.request_id)
        del self._order[bisect.bisect_left(self._order, place)]  # (p, t, s) sorts just before (p, t, s, request)
        return place

    def remove(self, request: Request) -> None:
        super().remove(request)
        place = self._delete(request)
        if not request.aged:
            del self._young[bisect.bisect_left(self._young, place[1:])]

    def promote(self, arrived_by: float) -> None:
        """Age every waiting request that arrived at or before ``arrived_by``: it ranks first
        from now on (``Request.aged`` stays set when it runs or is preempted)."""
        end = bisect.bisect_right(self._young, (arrived_by, float("inf")))
        for _, seq, request in self._young[:end]:
            self._delete(request)
            request.aged = True
            self._insert(request, seq)
        del self._young[:end]

    def by_priority(self, running: Mapping[FairKey, int], limit: int) -> Iterator[Request]:
        """The first ``limit`` waiting requests by (rank, arrival), each rank's in tenants'
        turns (``fair_turns``; the aged ones first come first served). Do not change the queue
        while iterating."""
        order, end, start = self._order, min(limit, len(self._order)), 0
        while start < end:
            stop = start
            while stop < end and order[stop][0] == order[start][0]:
                stop += 1
            block = [entry[3] for entry in order[start:stop]]
            yield from block if order[start][0] == AGED_RANK else fair_turns(block, running)
            start = stop

    def check_invariants(self) -> None:
        assert len(self._order) == len(self._places) == len(self), "priority order out of sync"
        assert all(self._places[entry[3].request_id] == entry[:3] for entry in self._order)
        assert all(a[:3] < b[:3] for a, b in itertools.pairwise(self._order)), "priority order unsorted"
        assert all(self._places[request.request_id][1:] == (arrival, seq) and not request.aged
                   for arrival, seq, request in self._young), "young requests out of sync"
        assert all(a[:2] < b[:2] for a, b in itertools.pairwise(self._young)), "young requests unsorted"
        assert len(self._young) == sum(not entry[3].aged for entry in self._order), "young requests out of sync"


class Fcfs:
    """First come, first served (``WaitQueue.in_turn``); the base of the other policies."""

    name = FCFS
    # Running requests are kept sorted by this key (None: in admission order); the last one is
    # preempted first when the KV pool runs out.
    running_key: Callable[[Request], tuple] | None = None

    def new_queue(self) -> WaitQueue:
        return WaitQueue()

    def admission_order(self, waiting: WaitQueue, running: Sequence[Request], running_in_group: Counter[str],
                        scan: int, now: float, cached_tokens: Callable[[Request], int]) -> Iterator[Request]:
        """Waiting requests in the order admission tries them (the scheduler looks at the
        first ``scan``); ``cached_tokens``: a request's cached prefix (a pure query)."""
        return waiting.in_turn(running_in_group.__getitem__)

    def may_displace(self, head: Request, victim: Request, now: float) -> bool:
        """Whether the waiting ``head`` would be admitted before ``victim`` were the victim
        preempted (and so put back to wait): only then may fairness preempt it."""
        return True

    def arrived(self, request: Request, waiting: WaitQueue | None, running_in_group: Mapping[str, int]) -> None:
        """``request`` is about to join ``waiting`` (None: a preempted one, which goes first)."""

    def admitted(self, count: int, now: float) -> None:
        """A step admitted ``count`` waiting requests."""

    def check_invariants(self, waiting: WaitQueue, running: Sequence[Request]) -> None:
        if self.running_key is not None:
            keys = [self.running_key(request) for request in running]
            assert keys == sorted(keys), "running requests out of policy order"


class Priority(Fcfs):
    name = PRIORITY

    def __init__(self, max_wait_s: float = DEFAULT_PRIORITY_MAX_WAIT_S) -> None:
        self.max_wait_s = max_wait_s

    @staticmethod
    def running_key(request: Request) -> tuple:
        return priority_rank(request), request.arrival_time

    def new_queue(self) -> WaitQueue:
        return PriorityWaitQueue()

    def admission_order(self, waiting: WaitQueue, running: Sequence[Request], running_in_group: Counter[str],
                        scan: int, now: float, cached_tokens: Callable[[Request], int]) -> Iterator[Request]:
        assert isinstance(waiting, PriorityWaitQueue)
        waiting.promote(now - self.max_wait_s)
        return waiting.by_priority(running_by_tenant(running), scan)

    def may_displace(self, head: Request, victim: Request, now: float) -> bool:
        # equal ranks: the head's tenant runs nothing, so fair turns put it before the victim
        aged = head.aged or now - head.arrival_time >= self.max_wait_s
        return (AGED_RANK if aged else head.priority) <= priority_rank(victim)

    def check_invariants(self, waiting: WaitQueue, running: Sequence[Request]) -> None:
        super().check_invariants(waiting, running)
        assert isinstance(waiting, PriorityWaitQueue)
        waiting.check_invariants()


class CacheAware(Fcfs):
    """Longest cached prefix first, with aging measured from each request's FCFS turn: the time
    first come, first served would have admitted it, taken as the moment the scheduler has made
    as many admissions since it arrived as ``fcfs``'s order had requests ahead of it (whoever
    they admitted). Aged once ``max_wait_s`` has passed since then. Counted from arrival instead, a
    burst that outlasts the bound would age every request and serve the burst FCFS."""

    name = CACHE_AWARE

    def __init__(self, max_wait_s: float) -> None:
        self.max_wait_s = max_wait_s
        self._admissions = 0
        self._turns: list[tuple[int, int, Request]] = []  # a min-heap of (FCFS turn, seq, request) not yet due
        self._seq = itertools.count()

    def arrived(self, request: Request, waiting: WaitQueue | None, running_in_group: Mapping[str, int]) -> None:
        if request.fcfs_due_time is not None:  # preempted after its turn came: it keeps that time
            return
        ahead = 0 if waiting is None else waiting.ahead_of_new(request, running_in_group)
        if ahead == 0:
            request.fcfs_due_time = request.arrival_time
        else:
            heapq.heappush(self._turns, (self._admissions + ahead, next(self._seq), request))

    def admitted(self, count: int, now: float) -> None:
        self._admissions += count
        while self._turns and self._turns[0][0] <= self._admissions:
            request = heapq.heappop(self._turns)[2]
            if request.fcfs_due_time is None:  # an admitted or aborted one's time is set harmlessly
                request.fcfs_due_time = now

    def aged(self, request: Request, now: float) -> bool:
        due = request.fcfs_due_time
        return due is not None and now - due >= self.max_wait_s

    def admission_order(self, waiting: WaitQueue, running: Sequence[Request], running_in_group: Counter[str],
                        scan: int, now: float, cached_tokens: Callable[[Request], int]) -> Iterator[Request]:
        """The first ``scan`` requests of the FCFS order: the aged ones first (in that order),
        then the others by cached tokens, most first; equals in tenants' turns."""
        candidates = list(itertools.islice(waiting.in_turn(running_in_group.__getitem__), scan))
        tenants = running_by_tenant(running)
        aged: list[Request] = []
        by_hit: dict[int, list[Request]] = {}
        for request in candidates:
            if self.aged(request, now):
                aged.append(request)
            else:
                by_hit.setdefault(cached_tokens(request), []).append(request)
        order = fair_turns(aged, tenants)
        for hit in sorted(by_hit, reverse=True):
            order += fair_turns(by_hit[hit], tenants)
        return iter(order)

    def may_displace(self, head: Request, victim: Request, now: float) -> bool:
        # a preempted victim keeps its blocks cached, so it would outrank a head that is not aged
        return self.aged(head, now)

    def check_invariants(self, waiting: WaitQueue, running: Sequence[Request]) -> None:
        super().check_invariants(waiting, running)
        pending = {id(entry[2]) for entry in self._turns}
        assert all(r.fcfs_due_time is not None or id(r) in pending for r in waiting), "a request without a turn"
        assert all(turn > self._admissions for turn, _, _ in self._turns), "a turn that came but was not marked"


def make_policy(name: str, max_wait_s: float | None = None) -> Fcfs:
    """``max_wait_s``: the aging bound (None: the policy's default)."""
    wait = default_max_wait_s(name) if max_wait_s is None else max_wait_s
    if name == FCFS:
        return Fcfs()
    if name == PRIORITY:
        return Priority(wait)
    if name == CACHE_AWARE:
        return CacheAware(wait)
    raise ValueError(f"scheduling policy must be one of {POLICIES}, got {name!r}")
