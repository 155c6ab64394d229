"""Feeds a ``PrefixRouter`` from the replicas' KV event streams (``kv_events.py``).

One thread owns one SUB socket per replica (subscribed to its KV topic and its hybrid
state topic) and applies each batch to that replica's ``PrefixIndex`` under the
router's lock. A gap in a stream's sequence numbers (ZMQ drops messages past its
high-water mark, and a subscriber joining late misses the start) is filled from the
replica's replay socket when it has one; without one the replica's index is cleared
and rebuilt from what comes next (an index that under-reports only costs hits).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from hyprefix.kv_events import decode_batch, replay
from hyprefix.routing.policy import PrefixRouter

log = logging.getLogger("hyprefix.routing")


@dataclass(frozen=True)
class ReplicaEndpoints:
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = "kv-events"
    state_topic: str = "hybrid-state"


class EventSubscriber:
    def __init__(self, router: PrefixRouter, lock: threading.Lock | None = None) -> None:
        import zmq

        self.router = router
        self.lock = lock or threading.Lock()
        self._ctx = zmq.Context.instance()
        self._sockets: dict[str, tuple[zmq.Socket, ReplicaEndpoints]] = {}
        self._next_seq: dict[tuple[str, str], int] = {}  # (replica, topic) -> the seq expected next
        self._changes: list[tuple[str, ReplicaEndpoints | None]] = []
        self._changes_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hyprefix-kv-subscriber", daemon=True)
        self._thread.start()

    def add(self, replica_id: str, endpoints: ReplicaEndpoints) -> None:
        with self._changes_lock:
            self._changes.append((replica_id, endpoints))

    def remove(self, replica_id: str) -> None:
        with self._changes_lock:
            self._changes.append((replica_id, None))

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    # ------------------------------------------------------------ the thread
    def _apply_changes(self) -> None:
        import zmq

        with self._changes_lock:
            changes, self._changes = self._changes, []
        for replica_id, endpoints in changes:
            old = self._sockets.pop(replica_id, None)
            if old is not None:
                old[0].close()
            if endpoints is None:
                with self.lock:
                    self.router.remove(replica_id)
                continue
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, 0)
            for topic in (endpoints.topic, endpoints.state_topic):
                sub.setsockopt_string(zmq.SUBSCRIBE, topic)
                self._next_seq[(replica_id, topic)] = 0
            sub.connect(endpoints.endpoint)
            self._sockets[replica_id] = (sub, endpoints)
            with self.lock:
                self.router.replica(replica_id)
            # catch up with what was published before the subscription reached it
            for topic in (endpoints.topic, endpoints.state_topic):
                self._fill_gap(replica_id, endpoints, topic, upto=None)

    def _run(self) -> None:
        import zmq

        while not self._stop.is_set():
            try:
                self._apply_changes()
                if not self._sockets:
                    self._stop.wait(0.05)
                    continue
                poller = zmq.Poller()
                for sock, _ in self._sockets.values():
                    poller.register(sock, zmq.POLLIN)
                ready = dict(poller.poll(50))
                for replica_id, (sock, endpoints) in list(self._sockets.items()):
                    while sock in ready and sock.poll(0):
                        topic, seq, payload = sock.recv_multipart()
                        self._receive(replica_id, endpoints, topic.decode(), int.from_bytes(seq, "big"), payload)
            except Exception:  # a bad message or a dead replica must not stop the others
                log.exception("KV event subscriber error")
        for sock, _ in self._sockets.values():
            sock.close()

    def _receive(self, replica_id: str, endpoints: ReplicaEndpoints, topic: str, seq: int, payload: bytes) -> None:
        expected = self._next_seq.get((replica_id, topic), 0)
        if seq < expected:
            return  # already applied (from a replay)
        if seq > expected:
            self._fill_gap(replica_id, endpoints, topic, upto=seq)
            if self._next_seq[(replica_id, topic)] > seq:
                return
        self._apply(replica_id, topic, seq, payload)

    def _apply(self, replica_id: str, topic: str, seq: int, payload: bytes) -> None:
        _, events = decode_batch(payload)
        with self.lock:
            self.router.replica(replica_id).index.apply(events)
        self._next_seq[(replica_id, topic)] = seq + 1

    def _fill_gap(self, replica_id: str, endpoints: ReplicaEndpoints, topic: str, upto: int | None) -> None:
        """Apply the replica's buffered messages from the next expected one (to ``upto``
        when given); without a replay socket, forget the replica's index and go on."""
        start = self._next_seq[(replica_id, topic)]
        if endpoints.replay_endpoint is None:
            if upto is not None:
                log.warning("replica %s: KV events %d..%d lost and no replay socket: its index restarts",
                            replica_id, start, upto - 1)
                with self.lock:
                    self.router.replica(replica_id).index.clear()
                self._next_seq[(replica_id, topic)] = upto
            return
        for seq, payload in replay(endpoints.replay_endpoint, start, topic):
            if seq >= self._next_seq[(replica_id, topic)] and (upto is None or seq < upto):
                self._apply(replica_id, topic, seq, payload)
        if upto is not None and self._next_seq[(replica_id, topic)] < upto:
            log.warning("replica %s: KV events %d..%d no longer in its replay buffer",
                        replica_id, self._next_seq[(replica_id, topic)], upto - 1)
            self._next_seq[(replica_id, topic)] = upto
