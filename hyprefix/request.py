"""Per-request state owned by the scheduler (plain data, no torch)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from hyprefix.outputs import RetentionGrant
from hyprefix.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(eq=False)  # identity: queues find and remove a request without comparing fields
class Request:
    """One sequence: prompt tokens plus the tokens generated so far.

    ``num_computed_tokens`` counts tokens whose K/V are in the request's blocks.
    A request samples a token whenever a step brings ``num_computed_tokens`` up to
    ``len(all_token_ids)``.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    cache_salt: str | None = None
    group: str | None = None  # the client call it belongs to (fair scheduling); None: its own group
    arrival_time: float = field(default_factory=time.time)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_preemptions: int = 0
    block_hashes: list[bytes] = field(default_factory=list)  # of full blocks, filled by the KV manager
    waiting_on: str | None = None  # id of the request computing this one's next blocks
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # Structured outputs: the sequence's parser (``structured.grammar.Grammar``, opaque here),
    # advanced by ``Scheduler.update`` only; the runner reads a step's masks of it
    grammar: Any = None
    # Speculative decoding: the request's draft proposer and counters (``speculative.DraftState``),
    # made on its first drafting chance
    drafting: Any = None
    num_new_tokens: int = 0  # tokens the last step appended (more than one after accepted drafts)
    # What the retention of its prefix got when it finished (``params.cache_ttl_s``; cache/retention.py)
    retention: RetentionGrant | None = None
    # Promoted by the priority policy's aging (scheduling_policy.py): it waited the bound, and
    # from then on ranks before every priority, waiting or running
    aged: bool = False
    # The cache-aware policy's aging clock (scheduling_policy.py): when first come, first served
    # would have admitted it (as many admissions as fcfs's order had ahead of it on arrival)
    fcfs_due_time: float | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def group_id(self) -> str:
        return self.request_id if self.group is None else self.group

    @property
    def priority(self) -> int:
        """Scheduling priority (``SamplingParams.priority``): lower is served earlier."""
        return self.params.priority

    @property
    def tenant(self) -> str | None:
        """Whose request this is, for fair shares between tenants (``scheduling_policy.py``): the
        API-key tenant a server bound to the cache salt (``"tenant|salt"``,
        ``server.serving.engine_salt``), else the salt up to its first ``|``; None without a salt."""
        return None if self.cache_salt is None else self.cache_salt.partition("|")[0]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_token_ids) + self.params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED

    def tokens_in(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    def check_stop(self) -> bool:
        """Token-level stop checks; sets the finish reason and returns True on a stop."""
        last = self.output_token_ids[-1]
        if not self.params.ignore_eos and last in self.eos_token_ids:
            self.finish_reason, self.stop_reason = "stop", None
        elif last in self.params.stop_token_set:
            self.finish_reason, self.stop_reason = "stop", last
        elif len(self.output_token_ids) >= self.params.max_tokens:
            self.finish_reason = "length"
        else:
            return False
        return True
