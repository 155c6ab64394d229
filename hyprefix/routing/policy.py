"""Which replica a request goes to: the longest cached prefix, balanced against load
(SGLang's cache-aware rule, on block hashes instead of text). No torch, no Ray.

For a request with block hashes ``h`` (the engine's own chained hashes: model identity
and cache salt in the root) and each replica's ``PrefixIndex`` (rebuilt from that
replica's cache events) plus what this router sent it that has not finished yet
(``in_flight``: blocks being computed there now, so a burst of requests on one new
system prompt follows its first request instead of computing it on every replica):

1. Imbalanced load (most loaded - least loaded > ``balance_abs`` requests and
   most loaded > ``balance_rel`` x least loaded): least loaded first.
2. Else the replica whose usable prefix is longest, if it covers at least
   ``min_match`` of the request's blocks (ties: the less loaded).
3. Else least loaded (ties: the one that was chosen least recently, so no replica
   starves).

The result is a ranking: a caller that finds the first one full tries the next.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from hyprefix.routing.index import PrefixIndex
from hyprefix.text import common_prefix


@dataclass(frozen=True)
class RoutingRule:
    balance_abs: int = 8
    balance_rel: float = 1.5
    min_match: float = 0.1


@dataclass
class ReplicaState:
    replica_id: str
    index: PrefixIndex = field(default_factory=PrefixIndex)
    in_flight: dict[str, list[bytes]] = field(default_factory=dict)  # request id -> its block hashes
    last_chosen: int = 0  # the router's decision counter when this replica was last first

    def usable_blocks(self, hashes: Sequence[bytes], prompt_is_block_aligned: bool = False) -> float:
        cached = self.index.usable_blocks(hashes, prompt_is_block_aligned)
        pending = max((common_prefix(hashes, other) for other in self.in_flight.values()), default=0)
        return max(cached, pending)



@dataclass(frozen=True)
class Decision:
    ranking: list[str]  # replica ids, most preferred first
    reason: str  # "imbalanced" | "prefix" | "least-loaded"
    matched_blocks: float  # usable blocks on the first replica


class PrefixRouter:
    """The routing state of one router: every replica's index and in-flight requests."""

    def __init__(self, rule: RoutingRule | None = None) -> None:
        self.rule = rule or RoutingRule()
        self.replicas: dict[str, ReplicaState] = {}
        self._decisions = 0

    def replica(self, replica_id: str) -> ReplicaState:
        state = self.replicas.get(replica_id)
        if state is None:
            state = self.replicas[replica_id] = ReplicaState(replica_id)
        return state

    def remove(self, replica_id: str) -> None:
        self.replicas.pop(replica_id, None)

    def choose(self, hashes: Sequence[bytes], loads: dict[str, int], prompt_is_block_aligned: bool = False
               ) -> Decision:
        """Rank the replicas in ``loads`` (replica id -> ongoing requests) for a request."""
        if not loads:
            raise ValueError("no replica to route to")
        self._decisions += 1
        ids = list(loads)
        by_load = sorted(ids, key=lambda r: (loads[r], self.replica(r).last_chosen, r))
        low, high = loads[by_load[0]], loads[by_load[-1]]
        rule = self.rule
        if high - low > rule.balance_abs and high > rule.balance_rel * low:
            decision = Decision(by_load, "imbalanced", self.replica(by_load[0]).usable_blocks(hashes))
        else:
            usable = {r: self.replica(r).usable_blocks(hashes, prompt_is_block_aligned) for r in ids}
            best = max(ids, key=lambda r: (usable[r], -loads[r], -self.replica(r).last_chosen))
            if hashes and usable[best] > 0 and usable[best] >= rule.min_match * len(hashes):
                decision = Decision([best] + [r for r in by_load if r != best], "prefix", usable[best])
            else:
                decision = Decision(by_load, "least-loaded", usable[by_load[0]])
        self.replica(decision.ranking[0]).last_chosen = self._decisions
        return decision

    def routed(self, replica_id: str, request_id: str, hashes: Sequence[bytes]) -> None:
        """The request went to ``replica_id``: its blocks count as held there until it ends."""
        if hashes:
            self.replica(replica_id).in_flight[request_id] = list(hashes)

    def finished(self, replica_id: str, request_id: str) -> None:
        state = self.replicas.get(replica_id)
        if state is not None:
            state.in_flight.pop(request_id, None)
