"""The engine loop in a background thread, with one asyncio stream of outputs per caller.

The ``Engine`` is synchronous and not thread-safe, so exactly one thread (the
engine thread) ever touches it: callers on the event loop send it commands
through a queue, which the loop drains between steps, and get outputs back
through ``loop.call_soon_threadsafe``. When nothing is in flight the thread
maps the K/V pool's pages ahead of their first write, a few MiB between looks at
the command queue, until all are mapped (``Engine.map_kv_pages``), then blocks on
the command queue; it never spins.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from hyprefix.engine import Engine
from hyprefix.outputs import RequestOutput

log = logging.getLogger("hyprefix.async_engine")

T = TypeVar("T")


class EngineClosedError(RuntimeError):
    """The engine is shutting down or has stopped; no new work is accepted."""


class EngineDeadError(RuntimeError):
    """The engine loop failed; in-flight and new requests cannot be served."""


@dataclass
class _Command:
    fn: Callable[[], Any]
    future: asyncio.Future | None = None  # None: fire and forget
    adds: bool = False  # adds requests: held while a weight update waits for the engine to drain


PAUSE_MODES = ("abort", "in_place")


_STOP = object()


class OutputStream:
    """Outputs of one or more engine requests, delivered on the event loop.

    Iterating yields lists of ``RequestOutput`` (the latest cumulative output of
    each request that progressed since the last iteration) and ends when every
    request added to the stream has finished. ``close()`` aborts the unfinished
    ones; call it (e.g. in ``finally``) whenever the consumer stops early.

    Outputs coalesce: a consumer that falls behind gets each request's latest
    output, never a backlog, so a stream holds at most one output per request. A
    consumer that takes nothing for ``stall_timeout`` seconds while outputs wait
    (a client that stopped reading) has its requests aborted and their blocks freed.
    """

    def __init__(self, engine: AsyncEngine, stall_timeout: float | None = None) -> None:
        self._engine = engine
        self._stall_timeout = stall_timeout
        self._latest: dict[str, RequestOutput] = {}  # unread outputs, the newest per request
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self._unread_since: float | None = None  # when the oldest unread output arrived
        self._unfinished: set[str] = set()
        self._closed = False
        self.stalled = False

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> list[RequestOutput]:
        while True:
            if self._error is not None:
                self._unfinished.clear()
                raise self._error
            if self._latest:
                outputs, self._latest, self._unread_since = list(self._latest.values()), {}, None
                for out in outputs:
                    if out.finished:
                        self._unfinished.discard(out.request_id)
                return outputs
            if not self._unfinished:
                raise StopAsyncIteration
            self._ready.clear()
            await self._ready.wait()

    @property
    def num_buffered(self) -> int:
        """Outputs delivered and not yet read (at most one per request)."""
        return len(self._latest)

    def _put(self, out: RequestOutput) -> None:
        now = time.monotonic()
        if self._unread_since is None:
            self._unread_since = now
        self._latest[out.request_id] = out
        self._ready.set()
        if (self._stall_timeout and not out.finished and not self._closed
                and now - self._unread_since > self._stall_timeout):
            log.warning("aborting %s: its reader took nothing for %.0fs", ", ".join(sorted(self._unfinished)),
                        now - self._unread_since)
            self.stalled = True
            self.close()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._ready.set()

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def close(self) -> None:
        """Abort every request of this stream that has not finished (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for request_id in self._unfinished:
            self._engine.abort(request_id)
        self._unfinished.clear()


class AsyncEngine:
    """Runs ``Engine`` steps in one background thread and serves many asyncio callers.

    ``stats`` is a snapshot of ``Engine.get_stats()`` taken by the engine thread
    after every loop iteration; ``on_outputs`` (if given) is called on the engine
    thread with every step's outputs, finished ones included, whether or not a
    caller still listens.
    """

    def __init__(self, engine: Engine, on_outputs: Callable[[list[RequestOutput]], None] | None = None,
                 stall_timeout: float | None = None) -> None:
        self.engine = engine
        self.on_outputs = on_outputs
        self.stall_timeout = stall_timeout  # see OutputStream
        self.stats: dict[str, int | float] = engine.get_stats()
        self.iterations = 0  # loop iterations, for tests: it stays put while idle
        self.dead: BaseException | None = None
        self._commands: queue.SimpleQueue[_Command | object] = queue.SimpleQueue()
        self._streams: dict[str, OutputStream] = {}  # engine thread only
        # Generation control (engine thread only): paused, no step runs; an update that waits for
        # the requests in flight to finish, and the adds held meanwhile.
        self.paused = False
        self._update: _Command | None = None
        self._held: list[_Command] = []
        self._lock = threading.RLock()  # re-entrant: a GC finalizer may abort under it
        self._closing = False
        self._stopped = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------- event loop side
    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume outputs."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="hyprefix-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._closing and self.dead is None

    def open_stream(self) -> OutputStream:
        return OutputStream(self, self.stall_timeout)

    async def add(self, stream: OutputStream, request_ids: list[str], add: Callable[[Engine], T]) -> T:
        """Run ``add(engine)`` on the engine thread (it must call ``engine.add_request``
        for each of ``request_ids``, or raise having added none) and route those
        requests' outputs to ``stream``. Returns what ``add`` returns; its exceptions
        (ValueError for bad input) propagate."""

        def run() -> T:
            result = add(self.engine)
            for request_id in request_ids:
                self._streams[request_id] = stream
            return result

        stream._unfinished.update(request_ids)
        try:
            return await self.call(run, adds=True)
        except asyncio.CancelledError:
            stream.close()  # the aborts are queued behind the add, so they find the requests
            raise
        except BaseException:
            stream._unfinished.difference_update(request_ids)
            raise

    async def call(self, fn: Callable[[], T], adds: bool = False) -> T:
        """Run ``fn()`` on the engine thread between steps and return its result (``adds``:
        it adds requests, so it waits while a weight update drains the engine)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._submit(_Command(fn, future, adds))
        return await future

    # ------------------------------------------------------ generation control
    async def pause(self, mode: str = "abort") -> int:
        """Stop generating. ``abort``: every request in flight, running or waiting, ends now
        with what it has (finish reason ``abort``), delivered to its caller; ``in_place``:
        they keep their state and go on at ``resume``. Requests added while paused wait
        (validated and queued, not run). Returns how many requests were aborted."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")

        def run() -> int:
            self.paused = True
            return self._abort_delivering(self.engine.request_ids) if mode == "abort" else 0
        return await self.call(run)

    async def resume(self) -> None:
        """Generate again after ``pause``."""

        def run() -> None:
            self.paused = False
        await self.call(run)

    async def abort_requests(self, request_ids: list[str] | None = None) -> int:
        """Abort these engine requests (None: every one in flight); each caller gets its
        request's final output (what it has, finish reason ``abort``). Returns how many were
        in flight."""
        return await self.call(lambda: self._abort_delivering(
            self.engine.request_ids if request_ids is None else request_ids))

    async def update_weights(self, weights: Any, weight_version: str | None = None,
                             abort_all_requests: bool = False) -> dict[str, Any]:
        """``Engine.update_weights`` between steps, with SGLang's semantics for requests in
        flight: by default they finish under the old weights first (new requests wait until
        the update is done); with ``abort_all_requests`` they are aborted (callers get their
        partial outputs); while paused (``pause("in_place")``) the update runs at once and
        the paused requests go on under the new weights at ``resume``, with the K/V they
        computed before. Blocks of the old weights are never hit again either way."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def update() -> dict[str, Any]:
            return self.engine.update_weights(weights, weight_version)

        def run() -> None:
            if self._update is not None:
                raise RuntimeError("another weight update is in progress")
            if abort_all_requests:
                self._abort_delivering(self.engine.request_ids)
            command = _Command(update, future)
            if self.paused or not self.engine.has_unfinished_sequences():
                self._execute(command)
            else:  # drain: run in _run once the requests in flight are done
                self._update = command
        await self.call(run)
        return await future

    def abort(self, request_id: str) -> None:
        """Abort a request and free its blocks as soon as the engine thread gets to it.
        Safe from any thread; its outputs are no longer delivered."""

        def run() -> None:
            self._streams.pop(request_id, None)
            self.engine.abort(request_id)

        with contextlib.suppress(EngineClosedError, EngineDeadError):  # shutdown aborts everything anyway
            self._submit(_Command(run))

    def begin_shutdown(self) -> None:
        """Refuse new requests and abort the in-flight ones (their streams get a final
        ``abort`` output). Safe from a signal handler."""
        if self._closing:
            return
        self._closing = True

        def run() -> None:
            for request_id in list(self._streams):
                self.engine.abort(request_id)
            log.info("shutting down: aborted %d requests in flight", len(self._streams))

        with contextlib.suppress(EngineClosedError, EngineDeadError):
            self._submit(_Command(run), allow_closing=True)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort everything in flight, stop the engine thread and wait for it (blocking)."""
        self._closing = True
        with self._lock:
            if not self._stopped:
                self._commands.put(_STOP)
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("the engine thread did not stop within %.0fs", timeout)

    def _submit(self, command: _Command, allow_closing: bool = False) -> None:
        with self._lock:
            if self.dead is not None:
                raise EngineDeadError(f"the engine failed: {self.dead!r}")
            if self._stopped or (self._closing and not allow_closing and command.future is not None):
                raise EngineClosedError("the server is shutting down")
            self._commands.put(command)

    def _to_loop(self, fn: Callable[..., None], *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody listens any more
            self._loop.call_soon_threadsafe(fn, *args)

    # ------------------------------------------------------------ engine thread
    def _run(self) -> None:
        engine = self.engine
        try:
            running = True
            while running:
                idle = self.paused or not engine.has_unfinished()
                while idle and self._commands.empty() and engine.map_kv_pages():
                    pass  # map the K/V pool's pages a chunk at a time while nothing waits
                running = self._run_commands(block=idle)
                if running and self.paused:
                    self._dispatch(engine.take_outputs())  # aborted requests' outputs
                elif running and engine.has_unfinished():
                    outputs = engine.step()
                    self._dispatch(outputs)
                    if not outputs and not engine.has_unfinished_sequences():
                        # nothing schedulable yet something unfinished: wait, never spin
                        running = self._run_commands(block=True, timeout=0.05)
                if running and self._update is not None and (self.paused or not engine.has_unfinished()):
                    self._finish_update()
                self.stats = engine.get_stats()
                self.iterations += 1
        except BaseException as exc:
            log.exception("the engine loop failed; failing every request in flight")
            with self._lock:
                self.dead = exc
            error = EngineDeadError(f"the engine failed: {exc!r}")
            for stream in set(self._streams.values()):
                self._to_loop(stream._fail, error)
            self._streams.clear()
        finally:
            with self._lock:
                self._stopped = True
            self._fail_pending_commands()
            self.engine.close()
            log.info("engine loop stopped")

    def _run_commands(self, block: bool, timeout: float | None = None) -> bool:
        """Run queued commands (waiting for one first when ``block``); False on stop."""
        commands = []
        if block:
            with contextlib.suppress(queue.Empty):
                commands.append(self._commands.get(timeout=timeout))
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                break
        for i, command in enumerate(commands):
            if command is _STOP:
                for later in commands[i + 1:]:
                    self._commands.put(later)  # failed in _run's finally
                self._stop()
                return False
            self._execute(command)
        return True

    def _abort_delivering(self, request_ids: list[str]) -> int:
        """Abort these requests; unlike ``abort``, their streams get the final outputs."""
        aborted = sum(self.engine.abort(request_id) for request_id in request_ids)
        if aborted:
            log.info("aborted %d requests", aborted)
        return aborted

    def _finish_update(self) -> None:
        """Run the drained weight update, then the adds held while it waited."""
        update, self._update = self._update, None
        self._execute(update)
        held, self._held = self._held, []
        for command in held:
            if command.future is None or not command.future.cancelled():  # its caller left: nothing to add
                self._execute(command)

    def _execute(self, command: _Command) -> None:
        if command.adds and self._update is not None:
            self._held.append(command)
            return
        try:
            result = command.fn()
        except Exception as exc:
            if command.future is None:
                log.exception("engine command failed")
            else:
                self._to_loop(_settle, command.future, None, exc)
            return
        if command.future is not None:
            self._to_loop(_settle, command.future, result, None)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        if not outputs:
            return
        if self.on_outputs is not None:
            try:
                self.on_outputs(outputs)
            except Exception:
                log.exception("on_outputs hook failed")
        deliveries = []
        for out in outputs:
            stream = self._streams.pop(out.request_id, None) if out.finished else self._streams.get(out.request_id)
            if stream is not None:
                deliveries.append((stream, out))
        if deliveries:
            self._to_loop(_deliver, deliveries)

    def _stop(self) -> None:
        aborted = list(self._streams)
        for request_id in aborted:
            self.engine.abort(request_id)
        if self.engine.has_unfinished():
            self._dispatch(self.engine.step())  # flush the abort outputs to their streams
        self.stats = self.engine.get_stats()
        if aborted:
            log.info("shutdown aborted %d requests in flight", len(aborted))

    def _fail_pending_commands(self) -> None:
        error = (EngineClosedError("the server is shutting down") if self.dead is None
                 else EngineDeadError(f"the engine failed: {self.dead!r}"))
        if self._update is not None:  # an update still waiting for the engine to drain, and its held adds
            self._to_loop(_settle, self._update.future, None, error)
            self._update = None
        for command in self._held:
            if command.future is not None:
                self._to_loop(_settle, command.future, None, error)
        self._held = []
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Command) and command.future is not None:
                self._to_loop(_settle, command.future, None, error)


def _settle(future: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


def _deliver(deliveries: list[tuple[OutputStream, RequestOutput]]) -> None:
    for stream, out in deliveries:
        stream._put(out)
