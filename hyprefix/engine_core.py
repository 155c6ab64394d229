"""The engine core: schedule -> execute -> update, and nothing else (vLLM v1's ``EngineCore``).

One ``step`` asks the scheduler what runs, starts the structured-output masks of the rows that
need them (``structured/step_masks.py``, beside the forward), has the runner execute, and lets
the scheduler take the sampled tokens (it advances every grammar and ends finished requests).
The disk tier's worker side (``disk/connector.py``) runs at its fixed points of the step, and
the cache's KV events go out after it. Requests come in already checked (``input_processor.py``)
and their progress goes out as scheduler ``Request``s; text and ``RequestOutput``s are the
output processor's (``output_processor.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hyprefix.cache.coordinator import CacheCoordinator
from hyprefix.cache.events import EventLog
from hyprefix.disk.connector import DiskConnector
from hyprefix.engine_stats import StatsLogger, engine_stats
from hyprefix.kv_events import KVEventsConfig, ZmqEventPublisher
from hyprefix.outputs import PositionLogprobs
from hyprefix.request import Request
from hyprefix.runner.model_runner import ModelRunner
from hyprefix.scheduler import Scheduler

# A step with nothing to run while disk reads are under way waits this long for one.
DISK_LOAD_POLL_S = 0.05


@dataclass
class StepProgress:
    """What one step did: the requests that advanced (new tokens, or finished) and the
    logprobs it computed, by request id."""

    advanced: list[Request] = field(default_factory=list)
    logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list[PositionLogprobs]]] = field(default_factory=dict)


class EngineCore:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, cache: CacheCoordinator,
                 disk: DiskConnector | None, step_masks, cache_events: EventLog,
                 events: KVEventsConfig | None, log_stats_interval: float) -> None:
        """``step_masks``: starts a step's structured-output masks (``StepMasks``);
        ``events``: publish the cache's KV events over ZMQ (None: off)."""
        self.scheduler = scheduler
        self.runner = runner
        self.cache = cache
        self.disk = disk
        self.step_masks = step_masks
        self.cache_events = cache_events
        self.event_publisher = ZmqEventPublisher(events) if events is not None else None
        self._stats_logger = StatsLogger(log_stats_interval)

    def add(self, requests: list[Request]) -> None:
        for request in requests:
            self.scheduler.add_request(request)

    def has_work(self) -> bool:
        """Sequences waiting or running: whether another ``step`` can make progress."""
        return self.scheduler.has_unfinished()

    def step(self) -> StepProgress:
        disk = self.disk
        if disk is not None:
            disk.before_schedule(self.scheduler.requests)
        sched = self.scheduler.schedule()
        if sched.is_empty and not sched.finished_ids:
            if disk is not None:
                disk.wait_for_loads(DISK_LOAD_POLL_S)
            return StepProgress()
        if disk is not None:
            disk.before_forward()  # entries this step's allocations evicted, before the forward rewrites them
        masks = self.step_masks.start(sched, self.scheduler.requests)  # computed beside the forward
        result = self.runner.execute(sched, masks)
        advanced = self.scheduler.update(sched, result.sampled)
        if disk is not None:
            disk.after_step()  # write-through: what the step published
        self.publish_cache_events()
        self._stats_logger.maybe_log(self.scheduler, self.cache)
        return StepProgress(advanced, result.logprobs, result.prompt_logprobs)

    def map_kv_pages(self) -> bool:
        """While idle: map the K/V pool's next pages before their first write (``PageMapper``);
        False once all are mapped."""
        return self.runner.map_kv_pages()

    def set_model_identity(self, identity: str) -> None:
        """New weights run from now on: hashes chain from ``identity``, so nothing cached under
        the old weights is hit again (waiting requests rehash), nor kept for a later turn
        (retentions end: their blocks age out as plain cached blocks)."""
        self.cache.kv.set_model_identity(identity)
        self.cache.retention.clear()
        self.scheduler.forget_unstarted_hashes()

    def reset_prefix_cache(self) -> int:
        dropped = self.cache.reset_cache()
        self.publish_cache_events()
        return dropped

    def publish_cache_events(self) -> None:
        if self.event_publisher is not None:
            events = self.cache_events.drain()
            if events:
                self.event_publisher.publish(events)

    def stats(self, state_bytes: int) -> dict[str, int | float]:
        out = engine_stats(self.scheduler, self.cache, self.runner, state_bytes)
        return out | (self.disk.stats() if self.disk is not None else {})

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()

    def close(self) -> None:
        """Write the disk tier out (what memory holds) and stop its threads; stop the KV event
        publisher (its sockets) and the structured-output mask worker."""
        if self.disk is not None:
            self.disk.close()
        self.step_masks.close()
        if self.event_publisher is not None:
            self.event_publisher.close()
            self.event_publisher = None
