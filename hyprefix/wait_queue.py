"""The scheduler's queue of waiting requests: fair between groups, O(1) per change.

A *group* is what one client asked for in one call (an API request with several
prompts and ``n`` samples each is one group; a plain request is a group of its own).
Within a group requests keep their order; between groups the queue rotates, so a
call that queued thousands of sequences cannot keep a later one-line request
waiting behind all of them. Adding, re-queueing at the front (preemption) and
removing (abort, admission) are O(1); nothing compares requests by value.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping

from hyprefix.request import Request


class WaitQueue:
    def __init__(self) -> None:
        # group -> its waiting requests in order; the dict's order is the groups' rotation order
        self._groups: OrderedDict[str, OrderedDict[str, Request]] = OrderedDict()
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __contains__(self, request: Request) -> bool:
        queue = self._groups.get(request.group_id)
        return queue is not None and queue.get(request.request_id) is request

    def __iter__(self) -> Iterator[Request]:
        """Every waiting request, in admission order when no group is running anything."""
        return self.in_turn(lambda group: 0)

    def groups(self) -> Iterator[str]:
        return iter(self._groups)

    def head(self, group: str) -> Request:
        """The first waiting request of ``group``, one of ``groups()`` (never empty)."""
        return next(iter(self._groups[group].values()))

    def append(self, request: Request) -> None:
        self._add(request)

    def appendleft(self, request: Request) -> None:
        """Put a preempted request back first: at the front of its group, its group first."""
        self._add(request)
        self._groups[request.group_id].move_to_end(request.request_id, last=False)
        self._groups.move_to_end(request.group_id, last=False)

    def _add(self, request: Request) -> None:
        queue = self._groups.setdefault(request.group_id, OrderedDict())
        queue[request.request_id] = request
        self._len += 1

    def remove(self, request: Request) -> None:
        queue = self._groups[request.group_id]
        del queue[request.request_id]
        self._len -= 1
        if not queue:
            del self._groups[request.group_id]

    def ahead_of_new(self, request: Request, num_running: Mapping[str, int]) -> int:
        """How many waiting requests ``in_turn`` would try before ``request`` were it appended now
        (its first-come-first-served place, round k + 1 of the rotation): the k of its own group
        already waiting, up to k + 1 of every other group that runs no more requests than its
        group (sorted before it; ties counted ahead) and up to k of every one that runs more.
        ``num_running``: running requests by group, absent ones 0. O(groups running) for a
        request that is first in its group, O(groups) otherwise."""
        own = request.group_id
        k = len(self._groups.get(own, ()))
        mine = num_running.get(own, 0)
        if k == 0:  # one of every waiting group (its own has none), less those that run more than its group
            return len(self._groups) - sum(1 for group, running in num_running.items()
                                           if running > mine and group in self._groups)
        return k + sum(min(len(queue), k + (num_running.get(group, 0) <= mine))
                       for group, queue in self._groups.items() if group != own)

    def in_turn(self, num_running: Callable[[str], int]) -> Iterator[Request]:
        """Waiting requests in admission order: the first of every group, then the second
        of every group, and so on; groups with fewer running requests go first (ties keep
        the rotation order). Do not change the queue while iterating."""
        order = sorted(self._groups.items(), key=lambda item: num_running(item[0]))
        cursors = [iter(queue.values()) for _, queue in order]
        while cursors:
            alive = []
            for cursor in cursors:
                request = next(cursor, None)
                if request is not None:
                    yield request
                    alive.append(cursor)
            cursors = alive
