"""Sampling parameters and their validation (user errors raise ``RequestError``, a ValueError)."""

from __future__ import annotations

import reprlib
from dataclasses import dataclass, field, replace

from hyprefix.errors import RequestError
from hyprefix.structured.spec import StructuredOutputs
from hyprefix.text import check_text

# Every decode step checks every stop string (and id) of every running request, so one
# request's long lists would slow every other client's tokens.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
# What torch.Generator.manual_seed accepts (negative seeds wrap modulo 2**64).
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1


MAX_BAD_WORDS = 256
MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries
PENALTY_RANGE = 2.0  # presence / frequency penalties lie in [-2, 2] (OpenAI)
BIAS_RANGE = 100.0  # logit_bias values lie in [-100, 100] (OpenAI)
# ``priority`` (scheduling_policy.py): any 32-bit integer, lower served earlier
MIN_PRIORITY, MAX_PRIORITY = -(2**31), 2**31 - 1


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one prompt's completions (vLLM's names and meanings).

    temperature 0 means greedy. ``seed`` makes a request's samples reproducible
    whatever else is in the batch; with ``n > 1`` sample ``i`` uses ``seed + i``.

    Logits processing, in this order, only for requests that ask for it: ``allowed_token_ids``,
    ``bad_words``, ``min_tokens`` (EOS and ``stop_token_ids`` masked until that many tokens),
    ``logit_bias`` (token id -> added value), ``repetition_penalty`` (transformers': over the
    prompt and output tokens, positive logits divided, negative ones multiplied), then
    ``frequency_penalty`` and ``presence_penalty`` (OpenAI's: over output tokens), then
    temperature, ``min_p``, ``top_k``, ``top_p``.

    ``structured_outputs``: the output must match a JSON schema, regex, choice or grammar
    (``structured/``); every token is sampled from those the grammar allows, before any
    other processing, and the output ends once the grammar is complete.

    ``logprobs``: the sampled token's log-probability and this many top ones per output
    token; ``prompt_logprobs``: the same for every prompt token but the first (a request
    that asks computes its whole prompt: it takes no prefix-cache hit). Both come from
    the model's float32 logits before any processing (vLLM's "raw" logprobs).

    ``skip_special_tokens`` (default True) leaves special tokens' text out of the output
    text. False keeps it, the stopping token's too: the EOS or ``stop_token_ids`` token that
    ended the request is always in ``token_ids`` and, as in vLLM, left out of the text unless
    ``include_stop_str_in_output``; with ``skip_special_tokens=False`` (unlike vLLM) its text
    is kept as well, so no token of ``token_ids`` is missing from the text (unless a ``stop``
    string cut it): RL clients read the text and the ids as one sequence.

    ``priority`` (vLLM's meaning; vLLM passes it beside the params, ``LLM.generate(...,
    priority=[...])`` here too): under ``--scheduling-policy priority`` lower values are served
    earlier, ties by arrival (``scheduling_policy.py``); the other policies take only 0.

    ``cache_ttl_s``: keep this request's prefix (prompt + output blocks, and for hybrids the state
    checkpoint at its end) cached this many seconds after it finishes, evicted only after every
    other cached block, within the engine's limits (``--max-retention-s``, the retention budget and
    the tenant's share: ``cache/retention.py``); what it got is ``CompletionOutput.retention``.
    None (the default): no retention of its own (the server may still keep a chat turn that ends
    in tool calls, ``--tool-call-retention-s``); 0: none at all. The server's field is
    ``cache_control`` (Anthropic's ``{"type": "ephemeral", "ttl": "5m"}``, as SGLang's and Dynamo's
    pinning take it); vLLM's RFCs propose the same under other names (``agent_hint`` TTLs, a
    ``kv_hints`` retain action, ``retention_directives``).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    structured_outputs: StructuredOutputs | None = None
    priority: int = 0
    cache_ttl_s: float | None = None
    stop_list: tuple[str, ...] = field(init=False, repr=False, compare=False)
    stop_token_set: frozenset[int] = field(init=False, repr=False, compare=False)
    # ``bad_words`` as token id sequences, set by the engine from its tokenizer (``with_bad_words_ids``)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check(_is_int(self.n) and self.n >= 1, "n", f"n must be an integer >= 1, got {self.n!r}")
        _check(_is_number(self.temperature) and self.temperature >= 0, "temperature",
               f"temperature must be a number >= 0, got {self.temperature!r}")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p",
               f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(_is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1), "top_k",
               f"top_k must be -1 (disabled) or an integer >= 1, got {self.top_k!r}")
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", f"min_p must be in [0, 1], got {self.min_p!r}")
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens",
               f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _check(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
               f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        _check(_is_int(self.priority) and MIN_PRIORITY <= self.priority <= MAX_PRIORITY, "priority",
               f"priority must be an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}], got {self.priority!r}")
        _check(self.cache_ttl_s is None or (_is_number(self.cache_ttl_s) and self.cache_ttl_s >= 0), "cache_ttl_s",
               f"cache_ttl_s must be a number of seconds >= 0 (or None), got {self.cache_ttl_s!r}")
        _check(self.seed is None or _is_int(self.seed), "seed", f"seed must be an integer or None, got {self.seed!r}")
        top = MAX_SEED - (self.n - 1)  # sample i of n uses seed + i
        _check(self.seed is None or MIN_SEED <= self.seed <= top, "seed",
               f"seed must be in [{MIN_SEED}, {top}]" + (f" with n={self.n}" if self.n > 1 else "")
               + f", got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -PENALTY_RANGE <= value <= PENALTY_RANGE, name,
                   f"{name} must be in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}], got {value!r}")
        _check(_is_number(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
               f"repetition_penalty must be a number > 0, got {self.repetition_penalty!r}")
        self._check_stops()
        self._check_token_lists()
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (_is_int(value) and value >= -1), name,
                   f"{name} must be an integer >= 0 (or -1: the whole vocabulary), got {value!r}")
        _check(self.truncate_prompt_tokens is None or (_is_int(self.truncate_prompt_tokens) and (
            self.truncate_prompt_tokens >= 1 or self.truncate_prompt_tokens == -1)), "truncate_prompt_tokens",
            f"truncate_prompt_tokens must be an integer >= 1 (or -1: max_model_len), got "
            f"{self.truncate_prompt_tokens!r}")
        if isinstance(self.structured_outputs, dict):
            object.__setattr__(self, "structured_outputs", StructuredOutputs(**self.structured_outputs))
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputs),
               "structured_outputs", "structured_outputs must be StructuredOutputs (or a dict of its fields)")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            _check(isinstance(getattr(self, name), bool), name, f"{name} must be a boolean")

    def _check_stops(self) -> None:
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
        ids = _id_list(self.stop_token_ids, "stop_token_ids", MAX_STOP_TOKEN_IDS)
        object.__setattr__(self, "stop_list", tuple(stop))
        object.__setattr__(self, "stop_token_set", frozenset(ids))

    def _check_token_lists(self) -> None:
        bias = self.logit_bias
        _check(bias is None or isinstance(bias, dict), "logit_bias",
               f"logit_bias must map token ids to numbers, got {reprlib.repr(bias)}")
        _check(len(bias or {}) <= MAX_LOGIT_BIAS, "logit_bias",
               f"logit_bias has {len(bias or {})} entries, more than the limit of {MAX_LOGIT_BIAS}")
        for token, value in (bias or {}).items():
            _check(_is_int(token) and token >= 0, "logit_bias", f"logit_bias keys must be token ids, got {token!r}")
            _check(_is_number(value) and -BIAS_RANGE <= value <= BIAS_RANGE, "logit_bias",
                   f"logit_bias values must be in [-{BIAS_RANGE:g}, {BIAS_RANGE:g}], got {value!r} for token {token}")
        allowed = self.allowed_token_ids
        _check(allowed is None or len(_id_list(allowed, "allowed_token_ids", None)) > 0, "allowed_token_ids",
               "allowed_token_ids must not be empty")
        words = self.bad_words
        _check(words is None or (isinstance(words, list | tuple) and len(words) <= MAX_BAD_WORDS
                                 and all(isinstance(w, str) and w.strip() for w in words)), "bad_words",
               f"bad_words must be a list of at most {MAX_BAD_WORDS} non-blank strings, got {reprlib.repr(words)}")
        for word in words or ():
            check_text(word, "a bad word", param="bad_words")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5  # as vLLM: tinier temperatures overflow, so they mean greedy

    @property
    def processes_logits(self) -> bool:
        """Whether anything changes this request's logits before temperature (``runner/logits.py``)."""
        return bool(self.allowed_token_ids or self.bad_words_token_ids or self.min_tokens or self.logit_bias
                    or self.repetition_penalty != 1.0 or self.presence_penalty or self.frequency_penalty)

    def with_bad_words_ids(self, ids: tuple[tuple[int, ...], ...]) -> SamplingParams:
        """A copy carrying ``bad_words`` as token id sequences (the engine's tokenizer's)."""
        params = replace(self)
        object.__setattr__(params, "bad_words_token_ids", ids)
        return params

    def for_sample(self, index: int) -> SamplingParams:
        """The params of sample ``index`` of an ``n``-sample request: its own seed; sample 0
        alone computes the prompt's logprobs (its siblings then take the prefix-cache hit)."""
        params = replace(self, seed=None if self.seed is None else self.seed + index, n=1,
                         prompt_logprobs=self.prompt_logprobs if index == 0 else None)
        object.__setattr__(params, "bad_words_token_ids", self.bad_words_token_ids)
        return params


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _id_list(ids: object, param: str, limit: int | None) -> list[int]:
    """``ids`` (None, or a list of token ids) as a list; raises ``RequestError`` otherwise."""
    _check(ids is None or isinstance(ids, list | tuple), param,
           f"{param} must be a list of non-negative integers, got {reprlib.repr(ids)}")
    ids = list(ids or ())
    _check(limit is None or len(ids) <= limit, param, f"{param} has {len(ids)} ids, more than the limit of {limit}")
    _check(all(_is_int(t) and t >= 0 for t in ids), param,
           f"{param} must be a list of non-negative integers, got {reprlib.repr(ids)}")
    return ids


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and x == x and x not in (
        float("inf"), float("-inf"))


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise RequestError(message, param=param)
