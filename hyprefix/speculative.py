"""Speculative decoding's drafts (plain data, no torch): the configuration, the prompt-lookup
(n-gram) proposer and the per-request bookkeeping that makes drafting adaptive.

A decoding request whose context ends in an n-gram (``prompt_lookup_max`` down to
``prompt_lookup_min`` tokens) seen earlier in its own prompt or output proposes the tokens that
followed the latest earlier occurrence, up to ``num_speculative_tokens``. The step then computes
the last sampled token and the drafts together (one row of 1 + k query tokens, paged attention
over the cache) and keeps the drafts the model itself would have produced (``runner/verify.py``);
the scheduler rolls ``num_computed_tokens`` back past the rejected ones before any block is
published, so rejected K/V is never findable.

Adaptive: a request's next draft is one token longer than its last when all of that one stood,
else as long as what stood plus one; a verification that accepts nothing makes the request skip
its next ``2**misses - 1`` drafting chances (capped), so text that does not repeat itself costs
almost nothing; any acceptance resets it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hyprefix.config import dataclass_from_json

METHODS = ("ngram",)
# vLLM's defaults for an ngram config that names neither bound.
DEFAULT_PROMPT_LOOKUP = 5
MAX_SKIPPED_CHANCES = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``speculative_config`` for prompt lookup: ``{"method": "ngram",
    "num_speculative_tokens": k, "prompt_lookup_min": a, "prompt_lookup_max": b}``. One bound
    given: the other takes its value; neither: both 5 (vLLM's rule)."""

    method: str = "ngram"
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: method {self.method!r} is not supported; supported: "
                             f"{list(METHODS)} (drafts from the request's own context, no draft model)")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config: num_speculative_tokens must be a positive integer, got {k!r}")
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low = high = DEFAULT_PROMPT_LOOKUP
        low = high if low is None else low
        high = low if high is None else high
        for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config: {name} must be a positive integer, got {value!r}")
        if low > high:
            raise ValueError(f"speculative_config: prompt_lookup_min ({low}) must be <= prompt_lookup_max ({high})")
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)

    @property
    def k(self) -> int:
        assert self.num_speculative_tokens is not None
        return self.num_speculative_tokens

    @classmethod
    def parse(cls, value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """A JSON object (the ``--speculative-config`` flag), a dict (``LLM(speculative_config=...)``)
        or None (off). Unknown keys are refused, never ignored."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        return dataclass_from_json(cls, value, "speculative_config")


@dataclass
class NgramIndex:
    """For each n-gram (``low`` <= n <= ``high``) of a token list, where its latest occurrence that
    has a follower ends. Grown token by token as the list grows, so a lookup costs
    ``high - low + 1`` dict reads whatever the context length."""

    low: int
    high: int
    ends: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0  # tokens[:indexed] have entered the index

    def extend(self, tokens: list[int]) -> None:
        """Index the tokens appended since the last call: the n-grams ending just before each
        new token now have a follower."""
        ends, low, high = self.ends, self.low, self.high
        for end in range(max(self.indexed, 1), len(tokens)):
            for n in range(low, min(high, end) + 1):
                ends[tuple(tokens[end - n:end])] = end
        self.indexed = len(tokens)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """``k`` tokens that followed the latest earlier occurrence of the longest n-gram the list
        ends in ([] when none occurs earlier). Where they reach the end of the list, the text
        repeats with the period from that occurrence to the end (a loop), so the drafts go on
        around it."""
        self.extend(tokens)
        size = len(tokens)
        for n in range(min(self.high, size - 1), self.low - 1, -1):
            end = self.ends.get(tuple(tokens[size - n:]))
            if end is not None:
                period = size - end
                return [tokens[end + i % period] for i in range(k)]
        return []


@dataclass
class SpecStats:
    """Verification counts (vLLM's ``spec_decode_*``), engine-wide or a request's: verifications,
    drafted tokens, accepted tokens, and accepted tokens by draft position (0: the first draft)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def add(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_pos) < drafted:
            self.accepted_per_pos.extend([0] * (drafted - len(self.accepted_per_pos)))
        for pos in range(accepted):
            self.accepted_per_pos[pos] += 1


@dataclass
class DraftState:
    """One request's drafting: its index, its adaptive back-off and its counts (the request's
    output metrics)."""

    index: NgramIndex
    tokens: list[int] = field(default_factory=list)  # the request's prompt and output, grown as it decodes
    length: int | None = None  # drafts to propose next (None: as many as allowed)
    misses: int = 0  # verifications in a row that accepted nothing
    skip: int = 0  # drafting chances still to skip
    counts: SpecStats = field(default_factory=SpecStats)  # this request's alone

    def context(self, prompt: list[int], output: list[int]) -> list[int]:
        """The request's tokens: a list of its own, extended by the output tokens it has not seen
        (building prompt + output anew every step would copy the whole context)."""
        tokens = self.tokens
        if not tokens:
            tokens.extend(prompt)
        tokens.extend(output[len(tokens) - len(prompt):])
        return tokens

    def propose(self, tokens: list[int], k: int) -> list[int]:
        if self.skip:
            self.skip -= 1
            return []
        return self.index.propose(tokens, k if self.length is None else min(k, self.length))

    def verified(self, drafted: int, accepted: int) -> None:
        self.counts.add(drafted, accepted)
        # the next draft: one longer than this one when all of it stood, else what stood and one
        # more (a refused draft costs its row in the step)
        self.length = drafted + 1 if accepted == drafted else accepted + 1
        if accepted:
            self.misses = 0
        else:
            self.misses += 1
            self.skip = min(2**self.misses - 1, MAX_SKIPPED_CHANCES)
