"""The grammar engine behind structured outputs: llguidance (a Rust Earley parser over the
tokenizer's vocabulary; no dependencies of its own, a wheel for every platform).

``GrammarCompiler`` (one per engine) turns a ``StructuredOutputs`` into a validated grammar,
once per distinct constraint (an LRU cache), and gives each sequence its own ``Grammar``: the
parser state that knows which tokens may come next (``fill_masks``) and advances with
each sampled token (``accept``, called by ``Scheduler.update`` only; the runner reads masks
through ``structured/step_masks.py``). A bad schema, regex or grammar is a ``RequestError``
naming the field, raised when the request is added.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hyprefix.errors import RequestError
from hyprefix.structured.spec import StructuredOutputs

if TYPE_CHECKING:
    from hyprefix.structured.step_masks import StepMasks

CACHE_SIZE = 512  # compiled grammars kept (distinct schemas, regexes, choices, grammars)
# JSON the model writes: no free whitespace between tokens (with it, a model may pad forever)
JSON_OPTIONS = {"whitespace_flexible": False}


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
    except ImportError as exc:  # a core dependency; only a broken install lacks it
        raise RuntimeError("structured outputs need the llguidance package: pip install llguidance") from exc
    return llguidance


class Grammar:
    """One sequence's parser state under a compiled grammar."""

    def __init__(self, matcher: Any, masks_first: bool = False) -> None:
        self.matcher = matcher
        self._masks_first = masks_first

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it (the parser is
        then in an error state and stays there)."""
        return self.matcher.consume_token(token_id)

    def allows(self, token_id: int) -> bool:
        """Whether the grammar takes this token next (the parser stays where it is)."""
        return self.matcher.validate_tokens([token_id]) == 1

    @property
    def masks_first(self) -> bool:
        """Set by the engine: the request's top-k, top-p or min-p read the masked
        distribution, so its logits are masked before sampling; otherwise its pick is
        checked after (``runner/sampler.py``)."""
        return self._masks_first

    def is_stopped(self) -> bool:
        """Whether the output is complete: nothing but EOS may follow (or the parser failed)."""
        return self.matcher.is_stopped()

    def is_error(self) -> bool:
        return self.matcher.is_error()

    def error(self) -> str:
        return self.matcher.get_error()


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary; builds the llguidance
    tokenizer on first use (a pass over the vocabulary: docs/benchmarks.md has its time)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._tokenizer = None
        self._grammars: OrderedDict[tuple[str, str], str] = OrderedDict()

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            llg = _llguidance()
            eos = sorted(self.eos_token_ids) or None
            self._tokenizer = llg.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size, eos_token=eos)
        return self._tokenizer

    def compile(self, spec: StructuredOutputs, param: str = "structured_outputs") -> str:
        """The validated grammar of ``spec`` (cached); a ``RequestError`` on ``param`` if invalid."""
        key = spec.key()
        grammar = self._grammars.get(key)
        if grammar is not None:
            self._grammars.move_to_end(key)
            return grammar
        grammar = self._grammar_text(spec, param)
        is_error, messages = _llguidance().LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise RequestError(f"invalid {spec.kind} for structured outputs: {messages[0]}", param=param)
        self._grammars[key] = grammar
        if len(self._grammars) > CACHE_SIZE:
            self._grammars.popitem(last=False)
        return grammar

    def _grammar_text(self, spec: StructuredOutputs, param: str) -> str:
        llg = _llguidance()
        matcher = llg.LLMatcher
        try:
            if spec.kind == "json":
                return matcher.grammar_from_json_schema(spec.json, defaults=JSON_OPTIONS)
            if spec.kind == "json_object":
                return matcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
            if spec.kind == "regex":
                return matcher.grammar_from_regex(spec.regex)
            if spec.kind == "choice":
                return llg.grammar_from("choice", json.dumps(list(spec.choice)))
            return llg.grammar_from("grammar", spec.grammar)
        except ValueError as exc:
            raise RequestError(f"invalid {spec.kind} for structured outputs: {exc}", param=param) from exc

    def grammar(self, spec: StructuredOutputs, param: str = "structured_outputs",
                masks_first: bool = False) -> Grammar:
        """A new sequence's parser for ``spec`` (``masks_first``: ``Grammar.masks_first``)."""
        matcher = _llguidance().LLMatcher(self.tokenizer, self.compile(spec, param), log_level=0)
        if matcher.is_error():
            raise RequestError(f"invalid {spec.kind} for structured outputs: {matcher.get_error()}", param=param)
        return Grammar(matcher, masks_first)

    def step_masks(self) -> StepMasks:
        """A new ``StepMasks`` for this vocabulary: the engine's, starting each step's masks
        (``structured/step_masks.py``)."""
        from hyprefix.structured.step_masks import StepMasks

        return StepMasks(self.vocab_size)

_executor = None


def fill_masks(grammars: list[Grammar], vocab_size: int) -> torch.Tensor:
    """The next-token bitmask of each grammar, int32 [len, ceil(vocab / 32)] (bit set: allowed);
    one llguidance thread (it runs beside the forward pass, ``structured/step_masks.py``)."""
    global _executor
    llg = _llguidance()
    import llguidance.torch as llg_torch

    if _executor is None:
        _executor = llg.LLExecutor(num_threads=1)
    bitmask = llg_torch.allocate_token_bitmask(len(grammars), vocab_size)
    llg_torch.fill_next_token_bitmask_par(_executor, [(g.matcher, i) for i, g in enumerate(grammars)], bitmask)
    return bitmask


def allowed_masks(grammars: list[Grammar], vocab_size: int) -> torch.Tensor:
    """The tokens each grammar takes next, bool [len, vocab_size] (True: allowed)."""
    return unpack_allowed(fill_masks(grammars, vocab_size), vocab_size)


def unpack_allowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A ``fill_masks`` bitmask as bool [R, vocab_size] (True: allowed)."""
    return torch.from_numpy(unpack_mask(bitmask)[:, :vocab_size])


def unpack_mask(bitmask: torch.Tensor) -> np.ndarray:
    """An int32 bitmask [R, ceil(V / 32)] as bool [R, 32 * ceil(V / 32)] (True: allowed; token
    32 * j + i is bit i of word j)."""
    return np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little").view(np.bool_)


def apply_masks(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, every logit whose bit in ``bitmask`` (int32 [R, ceil(V / 32)],
    one row per row of ``logits`` [R, V]) is clear."""
    logits.masked_fill_(~unpack_allowed(bitmask, logits.shape[1]).to(logits.device), float("-inf"))
