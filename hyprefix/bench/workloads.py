"""Request generators of the prefix-cache workloads (plain Python, no torch).

Every prompt is random token ids in ``[3, 4096)`` (the demo tokenizer has 4096 tokens and
ids 0-2 are its special tokens) drawn from a ``random.Random`` seeded with the workload's
name and ``seed``, so the same flags always give the same token ids, on every arm and on
a second model (``--compare-model``). Every request produces exactly ``output_len`` tokens
(``ignore_eos``), so the token counts, and therefore the hit rates, do not depend on what
the model says.

A workload is a sequence of *rounds*: the requests of one round are submitted together,
and round ``k + 1`` starts when round ``k`` has finished. ``round_requests(k, previous,
answers)`` builds round ``k`` from the previous round's requests and the output tokens the
engine actually produced for them (only ``multi-turn`` uses them).

``shared-prefix``
    ``groups`` × ``num_requests`` requests, one round: the requests of a group share one
    ``system_len``-token system prompt and each has its own ``suffix_len``-token user
    suffix; greedy.
``rl-burst``
    ``num_prompts`` × ``num_samples`` requests, one round: each prompt (``prompt_len``
    tokens) is submitted ``num_samples`` times as separate requests (not ``n > 1``), with
    temperature 1 and a distinct seed per request so the samples differ.
``multi-turn``
    ``conversations`` × ``turns`` requests in ``turns`` rounds: turn 0 of a conversation is a
    ``system_len``-token system prompt shared by every conversation plus a
    ``message_len``-token user message; turn ``k`` is turn ``k - 1``'s prompt, its answer
    (the engine's output tokens) and a new ``message_len``-token message; greedy.
``random``
    ``num_requests`` unrelated prompts in one round, lengths drawn uniformly from
    ``prompt_len * (1 - range_ratio) .. prompt_len * (1 + range_ratio)``; greedy. Nothing
    is shared: it shows what the cache costs when it cannot help (hit rate ~0).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import ClassVar

TOKEN_LOW = 3  # ids 0, 1, 2 are <|endoftext|>, <|im_start|>, <|im_end|> in the demo tokenizer
TOKEN_HIGH = 4096  # exclusive: the demo tokenizer's vocabulary size


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload round."""

    prompt: tuple[int, ...]
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    group: int = 0  # system-prompt group, prompt index or conversation index
    tag: str = ""  # a readable id: "g0/r3", "p0/s5", "c2/t4"

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(n))


def _positive(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name.replace('_', '-')} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class Workload:
    """Base of the workloads: seed, output length and the round interface."""

    name: ClassVar[str] = ""
    output_len: int = 32
    seed: int = 0

    @property
    def num_rounds(self) -> int:
        return 1

    @property
    def greedy(self) -> bool:
        return True

    def _rng(self, purpose: str = "") -> random.Random:
        return random.Random(f"{self.name}/{self.seed}/{purpose}")

    def round_requests(self, index: int, previous: Sequence[BenchRequest] = (),
                       answers: Sequence[Sequence[int]] = ()) -> list[BenchRequest]:
        raise NotImplementedError

    def num_requests_total(self) -> int:
        raise NotImplementedError

    def prompt_lens(self) -> list[list[int]]:
        """Prompt length of every request, per round (known in advance: outputs have a fixed length)."""
        raise NotImplementedError

    def max_concurrency(self) -> int:
        return max(len(r) for r in self.prompt_lens())

    def ideal_prefill_tokens(self) -> int | None:
        """Prompt tokens to compute when every distinct prefix is computed exactly once
        (None when the workload does not define it)."""
        return None

    def with_seed(self, seed: int) -> Workload:
        return replace(self, seed=seed)

    def params(self) -> dict:
        """The workload's flags (its dataclass fields without the derived ones)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}

    def describe(self) -> str:
        raise NotImplementedError

    def to_dict(self) -> dict:
        return {"name": self.name, **self.params(), "num_rounds": self.num_rounds,
                "num_requests_total": self.num_requests_total(), "greedy": self.greedy,
                "token_range": [TOKEN_LOW, TOKEN_HIGH], "ignore_eos": True,
                "ideal_prefill_tokens": self.ideal_prefill_tokens()}


@dataclass(frozen=True)
class OneRoundWorkload(Workload):
    """A workload of one round: ``requests()`` is everything."""

    def requests(self) -> list[BenchRequest]:
        raise NotImplementedError

    def round_requests(self, index: int, previous: Sequence[BenchRequest] = (),
                       answers: Sequence[Sequence[int]] = ()) -> list[BenchRequest]:
        if index != 0:
            raise IndexError(f"{self.name} has one round, asked for round {index}")
        return self.requests()

    def num_requests_total(self) -> int:
        return len(self.requests())

    def prompt_lens(self) -> list[list[int]]:
        return [[len(r.prompt) for r in self.requests()]]


@dataclass(frozen=True)
class SharedPrefixWorkload(OneRoundWorkload):
    name: ClassVar[str] = "shared-prefix"
    num_requests: int = 8
    system_len: int = 1024
    suffix_len: int = 64
    groups: int = 4
    output_len: int = 16

    def __post_init__(self) -> None:
        _positive(self, "num_requests", "system_len", "suffix_len", "groups", "output_len")

    def requests(self) -> list[BenchRequest]:
        rng = self._rng()
        systems = [_tokens(rng, self.system_len) for _ in range(self.groups)]
        out = []
        for g, system in enumerate(systems):
            for r in range(self.num_requests):
                out.append(BenchRequest(system + _tokens(rng, self.suffix_len), self.output_len, group=g,
                                        tag=f"g{g}/r{r}"))
        return out

    def ideal_prefill_tokens(self) -> int:
        return self.groups * (self.system_len + self.num_requests * self.suffix_len)

    def describe(self) -> str:
        groups = f"{self.groups} groups x " if self.groups > 1 else ""
        return (f"{groups}{self.num_requests} requests = {self.system_len}-token shared system prompt + "
                f"{self.suffix_len}-token unique suffix, submitted together; {self.output_len} output tokens, greedy")


@dataclass(frozen=True)
class RlBurstWorkload(OneRoundWorkload):
    name: ClassVar[str] = "rl-burst"
    num_prompts: int = 1
    num_samples: int = 8
    prompt_len: int = 512
    temperature: float = 1.0

    def __post_init__(self) -> None:
        _positive(self, "num_prompts", "num_samples", "prompt_len", "output_len")
        if not self.temperature > 0:
            raise ValueError(f"rl-burst samples need a temperature > 0, got {self.temperature!r}")

    @property
    def greedy(self) -> bool:
        return False

    def requests(self) -> list[BenchRequest]:
        rng = self._rng()
        prompts = [_tokens(rng, self.prompt_len) for _ in range(self.num_prompts)]
        seeds = self._rng("sampling-seeds")
        return [BenchRequest(prompt, self.output_len, temperature=self.temperature, seed=seeds.randrange(2**31),
                             group=p, tag=f"p{p}/s{s}")
                for p, prompt in enumerate(prompts) for s in range(self.num_samples)]

    def ideal_prefill_tokens(self) -> int:
        return self.num_prompts * self.prompt_len

    def describe(self) -> str:
        return (f"{self.num_prompts} prompts x {self.num_samples} samples, {self.prompt_len}-token prompts, "
                f"submitted together as separate requests with the same prompt (not n > 1); "
                f"{self.output_len} output tokens, temperature {self.temperature:g}, one seed per request")


@dataclass(frozen=True)
class MultiTurnWorkload(Workload):
    name: ClassVar[str] = "multi-turn"
    conversations: int = 4
    turns: int = 6
    system_len: int = 256
    message_len: int = 64
    _messages: tuple[tuple[tuple[int, ...], ...], ...] = field(init=False, repr=False, compare=False)
    _system: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _positive(self, "conversations", "turns", "system_len", "message_len", "output_len")
        rng = self._rng()
        object.__setattr__(self, "_system", _tokens(rng, self.system_len))
        object.__setattr__(self, "_messages", tuple(
            tuple(_tokens(rng, self.message_len) for _ in range(self.turns)) for _ in range(self.conversations)))

    @property
    def num_rounds(self) -> int:
        return self.turns

    def message(self, conversation: int, turn: int) -> tuple[int, ...]:
        return self._messages[conversation][turn]

    @property
    def system_prompt(self) -> tuple[int, ...]:
        return self._system

    def round_requests(self, index: int, previous: Sequence[BenchRequest] = (),
                       answers: Sequence[Sequence[int]] = ()) -> list[BenchRequest]:
        if not 0 <= index < self.turns:
            raise IndexError(f"{self.name} has {self.turns} turns, asked for turn {index}")
        if index == 0:
            prompts = [self._system + self.message(c, 0) for c in range(self.conversations)]
        else:
            if len(previous) != self.conversations or len(answers) != self.conversations:
                raise ValueError(f"turn {index} needs the {self.conversations} previous requests and answers, "
                                 f"got {len(previous)} and {len(answers)}")
            prompts = [prev.prompt + tuple(int(t) for t in answer) + self.message(c, index)
                       for c, (prev, answer) in enumerate(zip(previous, answers, strict=True))]
        return [BenchRequest(p, self.output_len, group=c, tag=f"c{c}/t{index}") for c, p in enumerate(prompts)]

    def num_requests_total(self) -> int:
        return self.conversations * self.turns

    def prompt_lens(self) -> list[list[int]]:
        first = self.system_len + self.message_len
        return [[first + k * (self.output_len + self.message_len)] * self.conversations for k in range(self.turns)]

    def describe(self) -> str:
        return (f"{self.conversations} conversations x {self.turns} turns: {self.system_len}-token shared system "
                f"prompt + {self.message_len}-token message, each later turn appends the previous answer and a new "
                f"{self.message_len}-token message; {self.output_len} output tokens per turn, greedy; conversations "
                f"run concurrently (turn k of all submitted together)")


@dataclass(frozen=True)
class RandomWorkload(OneRoundWorkload):
    name: ClassVar[str] = "random"
    num_requests: int = 32
    prompt_len: int = 512
    range_ratio: float = 0.5

    def __post_init__(self) -> None:
        _positive(self, "num_requests", "prompt_len", "output_len")
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"range-ratio must be in [0, 1), got {self.range_ratio!r}")

    def _lens(self) -> list[int]:
        rng = self._rng("lengths")
        low = max(1, round(self.prompt_len * (1 - self.range_ratio)))
        high = max(low, round(self.prompt_len * (1 + self.range_ratio)))
        return [rng.randint(low, high) for _ in range(self.num_requests)]

    def requests(self) -> list[BenchRequest]:
        rng = self._rng()
        return [BenchRequest(_tokens(rng, n), self.output_len, group=i, tag=f"r{i}")
                for i, n in enumerate(self._lens())]

    def ideal_prefill_tokens(self) -> int:
        return sum(self._lens())

    def describe(self) -> str:
        return (f"{self.num_requests} unrelated prompts of {self.prompt_len} tokens +/- "
                f"{100 * self.range_ratio:g}% (uniform), submitted together; {self.output_len} output tokens, greedy")


WORKLOAD_CLASSES: dict[str, type[Workload]] = {
    cls.name: cls for cls in (SharedPrefixWorkload, RlBurstWorkload, MultiTurnWorkload, RandomWorkload)}
