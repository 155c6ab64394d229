"""Timed workloads: requests that arrive over time, and the in-process driver that runs them.

A round workload (``workloads.py``) submits each round at once. A *timed* workload is a set of
*sessions*, each a start offset and a sequence of turns: turn 0 is sent at the session's start,
each later turn a *pause* after the previous turn's last token, its prompt the previous prompt +
the arm's answer + the turn's message (so later turns need the arm's answers, as in multi-turn).
A request's ``sent`` is its scheduled time (start or end of pause), not when a busy driver got to
it, so queueing counts in its TTFT. Lengths, pauses and arrivals are seeded: every arm and every
repeat gets the same ids and the same schedule (pauses run from each arm's own turn ends).

``agent``: sessions of tool-calling turns (a growing context, optional retention of each turn's
prefix through the pause: ``cache_ttl_s``); ``starvation``: a stream of requests sharing one hot
prefix beside a stream of cold ones, where a cache-preferring scheduler may keep postponing the
cold ones. ``run_engine_timed`` drives an ``Engine`` in real time (retention TTLs expire for
real); ``online.ServerArm.run_timed`` sends the same schedule to a server.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from hyprefix.bench.arms import RequestRecord
from hyprefix.bench.workloads import BenchRequest, Workload, check_range_ratio, length_range


@dataclass(frozen=True)
class Turn:
    message: tuple[int, ...]  # appended to the previous prompt and answer (turn 0: the whole prompt)
    pause_s: float  # before the turn, after the previous turn's end (turn 0: 0, the session's start rules)
    max_tokens: int
    tag: str
    cache_ttl_s: float = 0.0  # > 0: ask the engine to keep this turn's prefix that long after it ends


@dataclass(frozen=True)
class Session:
    start_s: float  # after the run's start
    turns: tuple[Turn, ...]
    group: int = 0


def _check_seconds(name: str, value: float, positive: bool = False) -> None:
    ok = value > 0 if positive else (value >= 0 and math.isfinite(value))
    if isinstance(value, bool) or not isinstance(value, int | float) or not ok:
        raise ValueError(f"{name.replace('_', '-')} must be a number {'> 0' if positive else '>= 0'}, got {value!r}")


def poisson_arrivals(rng: random.Random, rate: float, n: int) -> list[float]:
    """``n`` arrival times of a Poisson process at ``rate`` per second, the first one at 0."""
    return list(itertools.accumulate((rng.expovariate(rate) for _ in range(n - 1)), initial=0.0))


@dataclass(frozen=True)
class TimedWorkload(Workload):
    """Base of the timed workloads: ``sessions()`` is everything; one case, no rounds."""

    timed: ClassVar[bool] = True
    request_classes: ClassVar[tuple[str, ...]] = ()  # tag prefixes reported apart ("hot", "cold")

    def sessions(self) -> list[Session]:
        return self._sessions

    @functools.cached_property
    def _sessions(self) -> list[Session]:
        return self.make_sessions()

    def make_sessions(self) -> list[Session]:
        raise NotImplementedError

    @property
    def num_rounds(self) -> int:  # a record's ``round`` is its turn
        return max(len(s.turns) for s in self.sessions())

    def request(self, session: Session, k: int, previous: BenchRequest | None = None,
                answer: Sequence[int] = ()) -> BenchRequest:
        """Turn ``k`` of ``session``: after turn 0, ``previous`` (turn k-1) + ``answer`` + the message."""
        turn = session.turns[k]
        if k and previous is None:
            raise ValueError(f"turn {k} of a session needs the previous turn's request and answer")
        prompt = turn.message if k == 0 else previous.prompt + tuple(int(t) for t in answer) + turn.message
        return BenchRequest(prompt, turn.max_tokens, group=session.group, tag=turn.tag, cache_ttl_s=turn.cache_ttl_s)

    def round_requests(self, index: int, previous: Sequence[BenchRequest] = (),
                       answers: Sequence[Sequence[int]] = ()) -> list[BenchRequest]:
        raise TypeError(f"{self.name} is a timed workload: run it with run_timed, not round by round")

    def prompt_lens(self) -> list[list[int]]:
        """The longest prompt of each session (its last turn; outputs have a fixed length): a
        session's turns run one after another, so these are what may be live at once."""
        return [[sum(len(t.message) for t in s.turns) + (len(s.turns) - 1) * self.output_len
                 for s in self.sessions()]]

    def warm_up_workload(self) -> TimedWorkload:
        """A small copy with other ids: few short sessions, no pauses, no retention."""
        raise NotImplementedError


@dataclass(frozen=True)
class AgentWorkload(TimedWorkload):
    name: ClassVar[str] = "agent"
    num_sessions: int = 8
    turns: int = 4
    system_len: int = 512  # the shared system prompt and tool definitions
    message_len: int = 80  # mean of the user message and of each tool result
    range_ratio: float = 0.6  # message lengths and pauses uniform in mean * (1 -/+ ratio)
    tool_pause_s: float = 0.6
    request_rate: float = 4.0  # sessions started per second (Poisson)
    cache_ttl_s: float = 0.0
    output_len: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range_ratio(self.range_ratio)
        _check_seconds("tool_pause_s", self.tool_pause_s)
        _check_seconds("cache_ttl_s", self.cache_ttl_s)
        _check_seconds("request_rate", self.request_rate, positive=True)

    def _length(self, rng: random.Random) -> int:
        return rng.randint(*length_range(self.message_len, self.range_ratio))

    def make_sessions(self) -> list[Session]:
        rng, pauses = self._rng(), self._rng("pauses")
        system = self._tokens(rng, self.system_len)
        starts = poisson_arrivals(self._rng("arrivals"), self.request_rate, self.num_sessions)
        out = []
        for s, start in enumerate(starts):
            turns = []
            for k in range(self.turns):
                message = self._tokens(rng, self._length(rng))
                pause = 0.0 if k == 0 else pauses.uniform(self.tool_pause_s * (1 - self.range_ratio),
                                                          self.tool_pause_s * (1 + self.range_ratio))
                ttl = self.cache_ttl_s if k < self.turns - 1 else 0.0  # the last turn has no next one
                turns.append(Turn(system + message if k == 0 else message, pause, self.output_len, f"s{s}/t{k}", ttl))
            out.append(Session(start, tuple(turns), group=s))
        return out

    def warm_up_workload(self) -> AgentWorkload:
        return replace(self, seed=self.seed + 7919, output_len=min(self.output_len, 4),
                       num_sessions=min(self.num_sessions, 2), turns=min(self.turns, 2), tool_pause_s=0.0,
                       request_rate=math.inf, cache_ttl_s=0.0)

    def describe(self) -> str:
        low, high = length_range(self.message_len, self.range_ratio)
        ttl = (f"every turn but the last asks to keep its prefix {self.cache_ttl_s:g} s" if self.cache_ttl_s
               else "no retention asked")
        return (f"{self.num_sessions} agent sessions x {self.turns} turns, started at {self.request_rate:g} "
                f"sessions/s (Poisson): turn 1 = {self.system_len}-token shared system prompt and tools + a user "
                f"message, each later turn appends the previous answer and a tool result after a tool-call pause "
                f"of {self.tool_pause_s:g} s +/- {100 * self.range_ratio:g}%; messages {low}-{high} tokens; "
                f"{self.output_len} output tokens, greedy; {ttl}")


@dataclass(frozen=True)
class StarvationWorkload(TimedWorkload):
    name: ClassVar[str] = "starvation"
    request_classes: ClassVar[tuple[str, ...]] = ("hot", "cold")
    num_requests: int = 24  # hot requests
    num_cold_requests: int = 12
    system_len: int = 1024  # the hot prefix
    suffix_len: int = 32  # each hot request's own tokens
    prompt_len: int = 256  # each cold request's prompt
    request_rate: float = 8.0  # hot requests per second (Poisson)
    cold_request_rate: float = 4.0
    output_len: int = 16
    max_num_seqs: ClassVar[int] = 4  # the engine arms' slots unless set: a queue for the policy to order

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_seconds("request_rate", self.request_rate, positive=True)
        _check_seconds("cold_request_rate", self.cold_request_rate, positive=True)

    def make_sessions(self) -> list[Session]:
        rng = self._rng()
        prefix = self._tokens(rng, self.system_len)
        hot = [Session(t, (Turn(prefix + self._tokens(rng, self.suffix_len), 0.0, self.output_len, f"hot/r{i}"),),
                       group=0)
               for i, t in enumerate(poisson_arrivals(self._rng("hot-arrivals"), self.request_rate,
                                                      self.num_requests))]
        cold = [Session(t, (Turn(self._tokens(rng, self.prompt_len), 0.0, self.output_len, f"cold/r{i}"),),
                        group=1 + i)
                for i, t in enumerate(poisson_arrivals(self._rng("cold-arrivals"), self.cold_request_rate,
                                                       self.num_cold_requests))]
        return hot + cold

    def engine_defaults(self) -> dict:
        return {"max_num_seqs": self.max_num_seqs}

    def kv_blocks(self, block_size: int) -> int:
        """The hot prefix once (its last block may be partial: one more per hot request), the
        rest of every request whole."""
        def blocks(n: int) -> int:
            return -(-n // block_size)
        return (blocks(self.system_len) + self.num_requests * (1 + blocks(self.suffix_len + self.output_len))
                + self.num_cold_requests * blocks(self.prompt_len + self.output_len))

    def ideal_prefill_tokens(self) -> int:
        return self.system_len + self.num_requests * self.suffix_len + self.num_cold_requests * self.prompt_len

    def warm_up_workload(self) -> StarvationWorkload:
        return replace(self, seed=self.seed + 7919, output_len=min(self.output_len, 4),
                       num_requests=min(self.num_requests, 2), num_cold_requests=1, request_rate=math.inf,
                       cold_request_rate=math.inf)

    def describe(self) -> str:
        return (f"{self.num_requests} hot requests ({self.system_len}-token shared prefix + {self.suffix_len}-token "
                f"unique suffix) at {self.request_rate:g}/s beside {self.num_cold_requests} cold requests (unique "
                f"{self.prompt_len}-token prompts) at {self.cold_request_rate:g}/s, Poisson arrivals; "
                f"{self.output_len} output tokens, greedy; engine arms run {self.max_num_seqs} sequences at once "
                f"unless --max-num-seqs says otherwise")


TIMED_WORKLOADS: dict[str, type[TimedWorkload]] = {cls.name: cls for cls in (AgentWorkload, StarvationWorkload)}


@dataclass
class _Flight:
    session: int
    request: BenchRequest
    sent: float  # its scheduled time
    times: list[float] = field(default_factory=list)


def sampling_params(r: BenchRequest) -> Any:
    """The engine's ``SamplingParams`` of a bench request: exactly ``max_tokens`` tokens."""
    from hyprefix import SamplingParams

    return SamplingParams(temperature=r.temperature, top_p=1.0, top_k=-1, seed=r.seed, max_tokens=r.max_tokens,
                          ignore_eos=True, cache_ttl_s=r.cache_ttl_s or None)


def run_engine_timed(engine: Any, workload: TimedWorkload, ids: Iterator[int]) -> list[RequestRecord]:
    """Run ``workload``'s sessions on ``engine`` in real time: between steps, submit every turn
    whose time has come (its ``arrival_time`` set back to that time, so the scheduler ages it
    from then); step while anything runs, else sleep until the next turn is due. A token's time
    is the end of its step."""
    sessions = workload.sessions()
    start = time.perf_counter()
    due = [(start + s.start_s, i) for i, s in enumerate(sessions)]
    heapq.heapify(due)
    turn = [0] * len(sessions)
    previous: list[tuple[BenchRequest | None, list[int]]] = [(None, [])] * len(sessions)
    flight: dict[str, _Flight] = {}
    records: list[RequestRecord] = []
    while due or flight:
        now = time.perf_counter()
        while due and due[0][0] <= now:
            at, i = heapq.heappop(due)
            req = workload.request(sessions[i], turn[i], *previous[i])
            rid = f"bench-{next(ids)}"
            engine.add_requests([(rid, list(req.prompt), sampling_params(req))], arrival_time=time.time() - (now - at))
            flight[rid] = _Flight(i, req, at)
        if not flight:
            time.sleep(max(0.0, due[0][0] - time.perf_counter()))
            continue
        outputs = engine.step()
        now = time.perf_counter()
        if not outputs and not engine.has_unfinished_sequences():
            raise RuntimeError(f"engine went idle with {len(flight)} benchmark requests unfinished")
        for out in outputs:
            f = flight.get(out.request_id)
            if f is None:
                continue
            tokens = list(out.outputs[0].token_ids)
            f.times.extend([now] * (len(tokens) - len(f.times)))
            if not out.finished:
                continue
            del flight[out.request_id]
            i, grant = f.session, out.outputs[0].retention
            records.append(RequestRecord(f.request.tag, len(f.request.prompt), tokens, f.sent, f.times, now,
                                         round=turn[i], cached_tokens=out.num_cached_tokens,
                                         retained_tokens=None if grant is None else grant.num_tokens))
            previous[i], turn[i] = (f.request, tokens), turn[i] + 1
            if turn[i] < len(sessions[i].turns):
                heapq.heappush(due, (now + sessions[i].turns[turn[i]].pause_s, i))
    return records
