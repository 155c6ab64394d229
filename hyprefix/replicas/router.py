"""Ray Serve's ``RequestRouter`` for engine replicas: ``routing.policy.PrefixRouter`` on
the request's block hashes against each replica's cache, as its KV events tell.

It lives in the process that holds the deployment handle (the ingress). Each replica
reports its event endpoints in its ``record_replica_metadata``; the router subscribes
(``routing.subscriber``, a thread of its own) as replicas come and go. Load is the
number of requests this router assigned to a replica that have not completed (exact
with one ingress replica; with several, each balances its own share).

Ray Serve pickles this module by value (to ship the class): its globals must pickle,
so it reaches its metrics through the module ``hyprefix.metrics``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from hyprefix import metrics
from hyprefix.routing.assignments import Assignments
from hyprefix.routing.policy import PrefixRouter, RoutingRule
from hyprefix.routing.request_key import RoutingKey
from hyprefix.routing.subscriber import EventSubscriber, ReplicaEndpoints

ROUTING_KWARG = "routing"  # the deployment call's keyword argument holding the RoutingKey
METADATA_KEY = "kv_events"  # the replica metadata entry holding its ReplicaEndpoints fields
_UNROUTED_TTL_S = 600.0  # a request chosen and not routed for this long was cancelled while queued


class PrefixAwareRequestRouter(RequestRouter):
    def initialize_state(self, balance_abs: int = 8, balance_rel: float = 1.5, min_match: float = 0.1,
                         **_: Any) -> None:
        self._lock = threading.Lock()
        self.policy = PrefixRouter(RoutingRule(balance_abs, balance_rel, min_match))
        self._subscriber: EventSubscriber | None = None
        self._subscribed: set[str] = set()
        self.assignments = Assignments(self.policy)  # under self._lock: the subscriber thread reads the policy

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        current = {r.replica_id.unique_id: r for r in replicas}
        for replica_id, replica in current.items():
            endpoints = replica.replica_metadata.get(METADATA_KEY)
            if replica_id not in self._subscribed and endpoints:
                if self._subscriber is None:
                    self._subscriber = EventSubscriber(self.policy, self._lock)
                self._subscriber.add(replica_id, ReplicaEndpoints(**endpoints))
                self._subscribed.add(replica_id)
        for replica_id in self._subscribed - set(current):
            self._subscribed.discard(replica_id)
            self._subscriber.remove(replica_id)  # also forgets its index

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """The policy's ranking, one replica per rank. The first is assigned the request
        at once (its load and blocks), not when Ray confirms it: requests chosen
        meanwhile (a burst) already see it."""
        if not candidate_replicas:
            return []
        key = _key(pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        with self._lock:
            decision = self.policy.choose(key.hashes, {r: self.assignments.loads[r] for r in by_id},
                                          key.block_aligned)
            if pending_request is not None:
                now = time.monotonic()
                request = pending_request.metadata.internal_request_id
                with self._counting():
                    self.assignments.forget_stale(now - _UNROUTED_TTL_S)
                    self.assignments.chosen(request, decision.ranking[0], key.hashes, decision.reason, now)
        return [[by_id[r]] for r in decision.ranking]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        replica, request = replica_id.unique_id, pending_request.metadata.internal_request_id
        key = _key(pending_request)
        with self._lock:
            matched = self.policy.replica(replica).index.cached_blocks(key.hashes)
            with self._counting():
                reason = self.assignments.routed(request, replica, key.hashes)
        if ROUTING_KWARG in pending_request.kwargs:  # a generation call, not a control one (describe)
            metrics.ROUTER_METRICS.requests.labels(reason, replica).inc()
            metrics.ROUTER_METRICS.matched_blocks.labels(replica).inc(matched)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """Also called for an attempt the replica rejected (Ray chooses again for the retry)."""
        with self._lock, self._counting():
            self.assignments.completed(internal_request_id)

    @contextlib.contextmanager
    def _counting(self) -> Iterator[None]:
        """Carries the change in each replica's load to the running gauge (additive: a
        process can hold several routers)."""
        before = dict(self.assignments.loads)
        yield
        after = self.assignments.loads
        for replica in before.keys() | after.keys():
            if delta := after.get(replica, 0) - before.get(replica, 0):
                metrics.ROUTER_METRICS.running.labels(replica).inc(delta)


def _key(pending_request: PendingRequest | None) -> RoutingKey:
    key = pending_request.kwargs.get(ROUTING_KWARG) if pending_request is not None else None
    return key if isinstance(key, RoutingKey) else RoutingKey()
