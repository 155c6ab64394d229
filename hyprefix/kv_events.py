"""KV cache events over ZMQ in vLLM's wire format, for routers outside the engine.

Opt-in (``--kv-events-config '{"endpoint": "tcp://*:5557"}'``, the shape of vLLM's flag).
The engine drains ``cache.events.EventLog`` after every step and a publisher thread
sends one message per step that changed the cache.

Wire format (what vLLM's ``ZmqEventPublisher`` sends, so its subscribers, llm-d's
KV-cache indexer, Ray's and Dynamo's routers decode it):

- a PUB socket; each message has three frames: ``topic``, an 8-byte big-endian
  sequence number (0, 1, ... per stream), and a msgpack payload;
- payload: ``[ts, [event, ...]]`` (vLLM's ``KVEventBatch``, ``array_like`` msgspec
  structs, the optional ``data_parallel_rank`` omitted);
- ``["BlockStored", [hash, ...], parent_hash | None, [token_id, ...], block_size,
  lora_id (None), medium (None)]``; ``["BlockRemoved", [hash, ...], medium (None)]``;
  ``["AllBlocksCleared"]``. Hashes are 32-byte blake2b digests (msgpack bin).

Hybrid models (recurrent layers) also publish a second stream on ``state_topic``
(default ``hybrid-state``; not a prefix of the KV topic, so a KV subscriber never
sees it and vLLM decoders stay untouched), with its own sequence numbers:
``["StateStored", [hash, ...], before_last_token]`` and ``["StateRemoved", [hash, ...],
before_last_token]``: a state checkpoint sits at the end of each named block (or one
token before it). A prefix hit on a hybrid is usable up to the last block that has one.

Replay (``replay_endpoint``): a ROUTER socket; a client sends the 8-byte sequence
number to start from (and optionally a topic frame, the KV topic by default) and
receives ``[seq, payload]`` for each buffered message from there, then ``[-1, b""]``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

from hyprefix.cache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CacheEvent,
    StateRemoved,
    StateStored,
)
from hyprefix.config import dataclass_from_json

log = logging.getLogger("hyprefix.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True)
class KVEventsConfig:
    """``--kv-events-config`` (JSON): the fields of vLLM's flag we honour, plus ``state_topic``."""

    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    topic: str = "kv-events"
    state_topic: str = "hybrid-state"
    buffer_steps: int = 10_000  # messages kept per stream for replay
    hwm: int = 100_000  # ZMQ send high-water mark
    enable_kv_cache_events: bool = True
    publisher: str = "zmq"

    def __post_init__(self) -> None:
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv events publisher must be 'zmq' or 'null', got {self.publisher!r}")
        a, b = self.topic, self.state_topic
        if not a or not b or a.startswith(b) or b.startswith(a):
            raise ValueError(f"topic {a!r} and state_topic {b!r} must be non-empty and neither a prefix of "
                             "the other (ZMQ subscriptions match prefixes)")
        if self.buffer_steps < 1 or self.hwm < 0:
            raise ValueError("buffer_steps must be >= 1 and hwm >= 0")

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def read(cls, value: str | dict | KVEventsConfig) -> KVEventsConfig:
        """A JSON object (the ``--kv-events-config`` flag), a dict or a config: unknown keys are
        refused, never ignored. The result may be disabled (``enabled``)."""
        return value if isinstance(value, KVEventsConfig) else dataclass_from_json(cls, value, "kv_events_config")


# ------------------------------------------------------------------ encoding
def _event_array(event: CacheEvent) -> list:
    if isinstance(event, BlockStored):
        return ["BlockStored", list(event.block_hashes), event.parent_block_hash, list(event.token_ids),
                event.block_size, None, None]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", list(event.block_hashes), None]
    if isinstance(event, AllBlocksCleared):
        return ["AllBlocksCleared"]
    if isinstance(event, (StateStored, StateRemoved)):
        return [type(event).__name__, list(event.block_hashes), event.before_last_token]
    raise TypeError(f"not a cache event: {event!r}")


def encode_batch(events: list[CacheEvent], ts: float | None = None) -> bytes:
    import msgpack

    return msgpack.packb([time.time() if ts is None else ts, [_event_array(e) for e in events]], use_bin_type=True)


def decode_batch(payload: bytes) -> tuple[float, list[CacheEvent]]:
    """The inverse of ``encode_batch`` (tolerates vLLM's extra trailing fields)."""
    import msgpack

    ts, raw = msgpack.unpackb(payload, raw=False)[:2]
    events: list[CacheEvent] = []
    for item in raw:
        tag = item[0]
        if tag == "BlockStored":
            events.append(BlockStored(list(item[1]), item[2], list(item[3]), int(item[4])))
        elif tag == "BlockRemoved":
            events.append(BlockRemoved(list(item[1])))
        elif tag == "AllBlocksCleared":
            events.append(AllBlocksCleared())
        elif tag in ("StateStored", "StateRemoved"):
            kind = StateStored if tag == "StateStored" else StateRemoved
            events.append(kind(list(item[1]), bool(item[2]) if len(item) > 2 else False))
        else:
            raise ValueError(f"unknown cache event {tag!r}")
    return float(ts), events


def split_streams(events: list[CacheEvent]) -> tuple[list[CacheEvent], list[CacheEvent]]:
    """(KV events, state events), each in the cache's order."""
    state = [e for e in events if isinstance(e, (StateStored, StateRemoved))]
    return [e for e in events if not isinstance(e, (StateStored, StateRemoved))], state


def replay(endpoint: str, start: int, topic: str | None = None, timeout_ms: int = 2000) -> list[tuple[int, bytes]]:
    """(seq, payload) of every message a publisher's replay socket still holds from
    ``start`` on, for ``topic`` (its KV topic when None), in order."""
    import zmq

    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    out = []
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")] + ([topic.encode()] if topic else []))
        while dealer.poll(timeout_ms):
            _, seq, payload = dealer.recv_multipart()
            if not payload:
                break
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close()
    return out


# ----------------------------------------------------------------- publisher
class ZmqEventPublisher:
    """Binds the PUB (and replay) sockets and sends from a thread of its own, so the
    engine loop never blocks on the network. ``publish`` may be called from any thread."""

    def __init__(self, config: KVEventsConfig) -> None:
        try:
            import msgpack  # noqa: F401
            import zmq
        except ImportError as exc:
            raise ImportError(f"KV cache events need pyzmq and msgpack ({exc}): pip install 'hyprefix[events]'") \
                from exc

        self.config = config
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(config.endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)  # the bound port when ":0"/"*"
        self._replay = None
        self.replay_endpoint: str | None = None
        if config.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(config.replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._queue: queue.Queue[tuple[str, bytes] | None] = queue.Queue()
        self._seq = {config.topic: 0, config.state_topic: 0}
        self._buffers: dict[str, deque[tuple[int, bytes]]] = {
            topic: deque(maxlen=config.buffer_steps) for topic in self._seq}
        self._thread = threading.Thread(target=self._run, name="hyprefix-kv-events", daemon=True)
        self._thread.start()
        log.info("publishing KV cache events on %s (topic %r, hybrid state topic %r)%s", self.endpoint,
                 config.topic, config.state_topic,
                 f", replay on {self.replay_endpoint}" if self.replay_endpoint else "")

    def publish(self, events: list[CacheEvent]) -> None:
        kv, state = split_streams(events)
        ts = time.time()
        if kv:
            self._queue.put((self.config.topic, encode_batch(kv, ts)))
        if state:
            self._queue.put((self.config.state_topic, encode_batch(state, ts)))

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, then close the sockets."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        try:
            while True:
                try:
                    item = self._queue.get(timeout=0.05)
                except queue.Empty:
                    item = ()
                if item is None:
                    break
                if item:
                    self._send(*item)
                while self._replay is not None and poller.poll(0):
                    self._serve_replay()
        except Exception:  # the engine keeps serving without events
            log.exception("the KV event publisher stopped")
        finally:
            self._pub.close()
            if self._replay is not None:
                self._replay.close()

    def _send(self, topic: str, payload: bytes) -> None:
        seq = self._seq[topic]
        self._seq[topic] = seq + 1
        self._buffers[topic].append((seq, payload))
        self._pub.send_multipart([topic.encode(), seq.to_bytes(8, "big"), payload])

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        identity, rest = frames[0], [f for f in frames[1:] if f]  # REQ clients add an empty delimiter
        if not rest or len(rest[0]) != 8:
            self._replay.send_multipart([identity, b"", END_SEQ, b""])
            return
        start = int.from_bytes(rest[0], "big")
        topic = rest[1].decode() if len(rest) > 1 else self.config.topic
        for seq, payload in self._buffers.get(topic, ()):
            if seq >= start:
                self._replay.send_multipart([identity, b"", seq.to_bytes(8, "big"), payload])
        self._replay.send_multipart([identity, b"", END_SEQ, b""])
