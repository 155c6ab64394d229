"""Request generators of the workloads (plain Python, no torch).

Prompts are random token ids in ``[3, vocab_size)`` (0-2: the demo tokenizer's specials;
``vocab_size``: the model's, online ``--vocab-size`` / ``--tokenizer``, else 4096), seeded by the
workload's name and ``seed``, so every arm gets the same ids. Every request produces exactly
``output_len`` tokens (``ignore_eos``). A workload is one or more *cases* (throughput: prefill,
decode@B), each a sequence of *rounds* submitted one after another; ``round_requests(k,
previous, answers)`` builds round ``k`` (multi-turn appends each arm's answers). Timed
workloads, whose requests arrive over time, are in ``timed.py``.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import ClassVar

TOKEN_LOW = 3  # ids 0, 1, 2 are <|endoftext|>, <|im_start|>, <|im_end|> in the demo tokenizer
DEFAULT_VOCAB = 4096  # the demo tokenizer's size: the range when nothing says otherwise


def check_range_ratio(ratio: float) -> None:
    if not 0 <= ratio < 1:
        raise ValueError(f"range-ratio must be in [0, 1), got {ratio!r}")


def length_range(mean: int, ratio: float) -> tuple[int, int]:
    """The lengths (lowest, highest) drawn uniformly around ``mean`` +/- ``ratio``, at least 1."""
    low = max(1, round(mean * (1 - ratio)))
    return low, max(low, round(mean * (1 + ratio)))


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload round."""

    prompt: tuple[int, ...]
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    group: int = 0  # system-prompt group, prompt index or conversation index
    tag: str = ""  # a readable id: "g0/r3", "p0/s5", "c2/t4"
    cache_ttl_s: float = 0.0  # > 0: keep its prefix this long after it ends (SamplingParams.cache_ttl_s)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class Workload:
    """Base of the workloads: seed, output length, token range and the round interface."""

    name: ClassVar[str] = ""
    timed: ClassVar[bool] = False  # requests arrive over time (timed.py), not in rounds
    hf_batched: ClassVar[bool] = False  # transformers runs a round as one batch (else one request at a time)
    greedy: ClassVar[bool] = True
    output_len: int = 32
    seed: int = 0
    vocab_size: int = DEFAULT_VOCAB

    def __post_init__(self) -> None:
        for f in fields(self):  # every count (an int field but the seed) must be positive
            value = getattr(self, f.name)
            if f.type == "int" and f.name not in ("seed", "repeat") and (type(value) is not int or value < 1):
                raise ValueError(f"{f.name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.vocab_size <= TOKEN_LOW:
            raise ValueError(f"vocab-size must be > {TOKEN_LOW}, got {self.vocab_size!r}")

    @property
    def num_rounds(self) -> int:
        return 1

    def _rng(self, purpose: str = "") -> random.Random:
        return random.Random(f"{self.name}/{self.seed}/{purpose}")

    def _tokens(self, rng: random.Random, n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(TOKEN_LOW, self.vocab_size) for _ in range(n))

    def cases(self) -> dict[str, Workload]:
        """The separately measured parts of the workload, by name."""
        return {self.name: self}

    def for_repeat(self, repeat: int) -> Workload:
        """The workload of one timed repeat (the same token ids in every repeat)."""
        return self

    def engine_defaults(self) -> dict:
        """Engine arguments the workload needs unless the user sets them."""
        return {}

    def round_requests(self, index: int, previous: Sequence[BenchRequest] = (),
                       answers: Sequence[Sequence[int]] = ()) -> list[BenchRequest]:
        raise NotImplementedError

    def prompt_lens(self) -> list[list[int]]:
        """Prompt length of every request, per round (known in advance: outputs have a fixed length)."""
        raise NotImplementedError

    def kv_blocks(self, block_size: int) -> int:
        """KV blocks for every token of every request (the engine arms' default pool)."""
        return sum(-(-(n + self.output_len) // block_size) for lens in self.prompt_lens() for n in lens)

    def ideal_prefill_tokens(self) -> int | None:
        """Prompt tokens to compute when every distinct prefix is computed exactly once."""
        return None

    def describe(self) -> str:
        raise NotImplementedError

    def to_dict(self) -> dict:
        return {"name": self.name, **{f.name: getattr(self, f.name) for f in fields(self)},
                "token_range": [TOKEN_LOW, self.vocab_size], "ignore_eos": True}


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

    def requests(self) -> list[BenchRequest]:
        rng = self._rng()
        systems = [self._tokens(rng, self.system_len) for _ in range(self.groups)]
        return [BenchRequest(system + self._tokens(rng, self.suffix_len), self.output_len, group=g, tag=f"g{g}/r{r}")
                for g, system in enumerate(systems) for r in range(self.num_requests)]

    def ideal_prefill_tokens(self) -> int:
        return self.groups * (self.system_len + self.num_requests * self.suffix_len)

    def describe(self) -> str:
        groups = f"{self.groups} groups x " if self.groups > 1 else ""
        return (f"{groups}{self.num_requests} requests = {self.system_len}-token shared system prompt + "
                f"{self.suffix_len}-token unique suffix, submitted together; {self.output_len} output tokens, greedy")


@dataclass(frozen=True)
class RlBurstWorkload(OneRoundWorkload):
    name: ClassVar[str] = "rl-burst"
    greedy: ClassVar[bool] = False
    num_prompts: int = 1
    num_samples: int = 8
    prompt_len: int = 512
    temperature: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.temperature > 0:
            raise ValueError(f"rl-burst samples need a temperature > 0, got {self.temperature!r}")

    def requests(self) -> list[BenchRequest]:
        rng = self._rng()
        prompts = [self._tokens(rng, self.prompt_len) for _ in range(self.num_prompts)]
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

    @property
    def num_rounds(self) -> int:
        return self.turns

    @functools.cached_property
    def _texts(self) -> tuple[tuple[int, ...], list[list[tuple[int, ...]]]]:
        rng = self._rng()
        system = self._tokens(rng, self.system_len)
        return system, [[self._tokens(rng, self.message_len) for _ in range(self.turns)]
                        for _ in range(self.conversations)]

    def message(self, conversation: int, turn: int) -> tuple[int, ...]:
        return self._texts[1][conversation][turn]

    @property
    def system_prompt(self) -> tuple[int, ...]:
        return self._texts[0]

    def round_requests(self, index: int, previous: Sequence[BenchRequest] = (),
                       answers: Sequence[Sequence[int]] = ()) -> list[BenchRequest]:
        if not 0 <= index < self.turns:
            raise IndexError(f"{self.name} has {self.turns} turns, asked for turn {index}")
        if index == 0:
            prompts = [self.system_prompt + self.message(c, 0) for c in range(self.conversations)]
        else:
            if len(previous) != self.conversations or len(answers) != self.conversations:
                raise ValueError(f"turn {index} needs the {self.conversations} previous requests and answers, "
                                 f"got {len(previous)} and {len(answers)}")
            prompts = [prev.prompt + tuple(int(t) for t in answer) + self.message(c, index)
                       for c, (prev, answer) in enumerate(zip(previous, answers, strict=True))]
        return [BenchRequest(p, self.output_len, group=c, tag=f"c{c}/t{index}") for c, p in enumerate(prompts)]

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
        super().__post_init__()
        check_range_ratio(self.range_ratio)

    def _lens(self) -> list[int]:
        rng = self._rng("lengths")
        low, high = length_range(self.prompt_len, self.range_ratio)
        return [rng.randint(low, high) for _ in range(self.num_requests)]

    def requests(self) -> list[BenchRequest]:
        rng = self._rng()
        return [BenchRequest(self._tokens(rng, n), self.output_len, group=i, tag=f"r{i}")
                for i, n in enumerate(self._lens())]

    def ideal_prefill_tokens(self) -> int:
        return sum(self._lens())

    def describe(self) -> str:
        return (f"{self.num_requests} unrelated prompts of {self.prompt_len} tokens +/- "
                f"{100 * self.range_ratio:g}% (uniform), submitted together; {self.output_len} output tokens, greedy")


@dataclass(frozen=True)
class ThroughputCase(RandomWorkload):
    """A throughput case: ``num_requests`` prompts of ``prompt_len`` tokens, fresh every repeat."""

    name: ClassVar[str] = "throughput"
    range_ratio: float = 0.0
    repeat: int = 0

    def for_repeat(self, repeat: int) -> Workload:
        return replace(self, repeat=repeat)

    def _rng(self, purpose: str = "") -> random.Random:
        return super()._rng(f"{self.repeat}/{self.num_requests}/{self.output_len}/{purpose}")


@dataclass(frozen=True)
class ThroughputWorkload(Workload):
    name: ClassVar[str] = "throughput"
    hf_batched: ClassVar[bool] = True  # decode@B compares with transformers generating B rows at once
    prompt_len: int = 1024
    decode_prompt_len: int = 128
    decode_tokens: int = 64
    batch_sizes: tuple[int, ...] = (1, 16)
    output_len: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.decode_tokens < 2 or not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"decode-tokens must be >= 2 (the first token comes from the prefill) and batch sizes "
                             f">= 1, got {self.decode_tokens} and {list(self.batch_sizes)}")

    def cases(self) -> dict[str, Workload]:
        common = {"seed": self.seed, "vocab_size": self.vocab_size}
        out: dict[str, Workload] = {"prefill": ThroughputCase(num_requests=1, prompt_len=self.prompt_len,
                                                              output_len=1, **common)}
        for b in self.batch_sizes:
            out[f"decode@{b}"] = ThroughputCase(num_requests=b, prompt_len=self.decode_prompt_len,
                                                output_len=self.decode_tokens, **common)
        return out

    def prompt_lens(self) -> list[list[int]]:
        return [lens for case in self.cases().values() for lens in case.prompt_lens()]

    def engine_defaults(self) -> dict:
        # One step holds the whole prefill prompt, or every prompt of a decode batch.
        return {"max_num_batched_tokens": max(2048, *(sum(lens) for lens in self.prompt_lens()))}

    def describe(self) -> str:
        return (f"prefill of one {self.prompt_len}-token prompt (one new token); decode of "
                f"{self.decode_tokens} tokens at batch {', '.join(map(str, self.batch_sizes))} after "
                f"{self.decode_prompt_len}-token prompts; greedy, fresh prompts every repeat")



WORKLOAD_CLASSES: dict[str, type[Workload]] = {cls.name: cls for cls in (
    ThroughputWorkload, SharedPrefixWorkload, RlBurstWorkload, MultiTurnWorkload, RandomWorkload)}
