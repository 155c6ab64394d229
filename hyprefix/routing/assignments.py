"""Which replica each request counts against, from the router's choice until it ends:
the loads and in-flight blocks that ``policy.PrefixRouter`` weighs. No torch, no Ray.

A request router hears of a request three times, in an order it does not control:
``chosen`` (the policy ranked the replicas; the first counts the request at once, so a
burst chosen meanwhile sees it), ``routed`` (the replica accepted it, maybe not the
first choice) and ``completed`` (it ended, or that replica rejected it: a retry is
chosen again). Ray Serve runs its completion callbacks on the event loop as soon as the
result is done, and a short request can be done before the router resumes to report
the acceptance, so ``completed`` can come before ``routed``. ``routed`` therefore only
moves a live assignment and never makes one: making one there would count a finished
request against its replica for ever, and the least-loaded rule would then never pick
that replica for a new prefix.

Invariant: ``loads[r]`` is the number of live assignments to ``r``, and each live
assignment has its blocks in ``policy.replica(r).in_flight``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from hyprefix.routing.policy import PrefixRouter


@dataclass
class Assignments:
    policy: PrefixRouter
    loads: Counter[str] = field(default_factory=Counter)
    assigned: dict[str, str] = field(default_factory=dict)  # live request id -> replica
    unrouted: dict[str, tuple[float, str]] = field(default_factory=dict)  # chosen: id -> (when, reason)

    def chosen(self, request: str, replica: str, hashes: Sequence[bytes], reason: str, now: float) -> None:
        """The policy put ``replica`` first for ``request`` (again, for a retry)."""
        self.unrouted.pop(request, None)  # to the end: ``forget_stale`` reads in order of choice
        self.unrouted[request] = (now, reason)
        self._assign(request, replica, hashes)

    def routed(self, request: str, replica: str, hashes: Sequence[bytes]) -> str:
        """``replica`` accepted ``request``; returns the reason it was chosen for. Moves
        the request's assignment there if it is still live."""
        _, reason = self.unrouted.pop(request, (0.0, "least-loaded"))
        if request in self.assigned:
            self._assign(request, replica, hashes)
        return reason

    def completed(self, request: str) -> None:
        replica = self.assigned.pop(request, None)
        if replica is None:
            return
        self.loads[replica] -= 1
        if not self.loads[replica]:
            del self.loads[replica]
        self.policy.finished(replica, request)

    def forget_stale(self, cutoff: float) -> None:
        """Requests chosen before ``cutoff`` and never routed were cancelled while queued."""
        for request, (when, _) in list(self.unrouted.items()):
            if when >= cutoff:
                break
            del self.unrouted[request]
            self.completed(request)

    def _assign(self, request: str, replica: str, hashes: Sequence[bytes]) -> None:
        if self.assigned.get(request) == replica:
            return
        self.completed(request)
        self.assigned[request] = replica
        self.loads[replica] += 1
        self.policy.routed(replica, request, hashes)
