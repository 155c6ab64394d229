"""Sampling parameters and their validation (user errors raise ``RequestError``, a ValueError)."""

from __future__ import annotations

import reprlib
from dataclasses import dataclass, field

from hyprefix.errors import RequestError
from hyprefix.text import check_text

# Every decode step checks every stop string (and id) of every running request, so one
# request's long lists would slow every other client's tokens.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
# What torch.Generator.manual_seed accepts (negative seeds wrap modulo 2**64).
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one prompt's completions.

    temperature 0 means greedy. ``seed`` makes a request's samples reproducible
    whatever else is in the batch; with ``n > 1`` sample ``i`` uses ``seed + i``.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    stop_list: tuple[str, ...] = field(init=False, repr=False, compare=False)
    stop_token_set: frozenset[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check(isinstance(self.n, int) and not isinstance(self.n, bool) and self.n >= 1, "n",
               f"n must be an integer >= 1, got {self.n!r}")
        _check(_is_number(self.temperature) and self.temperature >= 0, "temperature",
               f"temperature must be a number >= 0, got {self.temperature!r}")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p",
               f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(isinstance(self.top_k, int) and not isinstance(self.top_k, bool)
               and (self.top_k == -1 or self.top_k >= 1), "top_k",
               f"top_k must be -1 (disabled) or an integer >= 1, got {self.top_k!r}")
        _check(isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool)
               and self.max_tokens >= 1, "max_tokens",
               f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _check(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)), "seed",
               f"seed must be an integer or None, got {self.seed!r}")
        top = MAX_SEED - (self.n - 1)  # sample i of n uses seed + i
        _check(self.seed is None or MIN_SEED <= self.seed <= top, "seed",
               f"seed must be in [{MIN_SEED}, {top}]" + (f" with n={self.n}" if self.n > 1 else "")
               + f", got {self.seed!r}")
        _check(self.stop is None or isinstance(self.stop, str | list | tuple), "stop",
               f"stop must be a non-empty string or a list of non-empty strings, got {reprlib.repr(self.stop)}")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        _check(len(stop) <= MAX_STOP_STRINGS, "stop",
               f"stop has {len(stop)} strings, more than the limit of {MAX_STOP_STRINGS}")
        _check(all(isinstance(s, str) and s for s in stop), "stop",
               f"stop must be a non-empty string or a list of non-empty strings, got {reprlib.repr(self.stop)}")
        for i, s in enumerate(stop):
            _check(len(s) <= MAX_STOP_STRING_CHARS, "stop",
                   f"stop string {i} has {len(s)} characters, more than the limit of {MAX_STOP_STRING_CHARS}")
            check_text(s, f"stop string {i}", param="stop")
        ids = self.stop_token_ids
        _check(ids is None or isinstance(ids, list | tuple), "stop_token_ids",
               f"stop_token_ids must be a list of non-negative integers, got {reprlib.repr(ids)}")
        _check(len(ids or ()) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
               f"stop_token_ids has {len(ids or ())} ids, more than the limit of {MAX_STOP_TOKEN_IDS}")
        _check(all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids or ()), "stop_token_ids",
               f"stop_token_ids must be a list of non-negative integers, got {reprlib.repr(ids)}")
        object.__setattr__(self, "stop_list", tuple(stop))
        object.__setattr__(self, "stop_token_set", frozenset(ids or ()))

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5  # as vLLM: tinier temperatures overflow, so they mean greedy

    def for_sample(self, index: int) -> SamplingParams:
        """The params of sample ``index`` of an ``n``-sample request."""
        seed = None if self.seed is None else self.seed + index
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=seed,
            max_tokens=self.max_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, n=1,
        )


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and x == x and x not in (
        float("inf"), float("-inf"))


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise RequestError(message, param=param)
