"""A step's structured-output masks, as the runner receives them (vLLM v1's shape).

The grammar state belongs to the scheduler side: each request's ``Grammar`` advances only in
``Scheduler.update``, by the tokens appended to it. Before a step runs, the engine hands the
step's ``SchedulerOutput`` to its ``StepMasks``, which starts, on a worker thread while the
forward pass runs, the next-token bitmask of every sampled row whose grammar masks first
(``Grammar.masks_first``), and returns a ``GrammarMasks``: the runner's read-only view of the
step's grammars. Through it the sampler reads the masks-first rows' bitmask, checks a pick
of the other grammar rows (``allows``) and, for a refused pick, reads that row's mask
(``allowed``); nothing in it advances a grammar.

Rows are named by request id: a grammar row never carries drafts, so it is one sampled row
of the step whatever order the runner lays its rows out in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from hyprefix.outputs import SchedulerOutput
from hyprefix.structured.grammar import allowed_masks, fill_masks


class GrammarMasks:
    """One step's grammar rows, read-only: which sampled rows have a grammar, which of them
    mask first, their bitmask (computed beside the forward) and checks of the other rows'
    picks. Valid for the step it was started for only: ``Scheduler.update`` advances the
    grammars after the runner returns, and the runner must not keep this object.

    ``grammars``: each grammar row's parser by request id (objects with ``allows(token)``,
    and what ``masks_of`` reads); ``first``: the request ids whose bitmask ``future``
    computes, in its row order; ``masks_of(grammars, vocab_size)``: bool [len, vocab_size]
    masks, computed when asked (``structured.grammar.allowed_masks``; a test passes its own
    for stand-in grammars)."""

    def __init__(self, grammars: Mapping[str, Any], first: Sequence[str] = (),
                 future: Future[torch.Tensor] | None = None,
                 masks_of: Callable[[list, int], torch.Tensor] = allowed_masks) -> None:
        assert (future is None) == (not first), "a bitmask is computed exactly when some row masks first"
        self._grammars = dict(grammars)
        self._first = {request_id: k for k, request_id in enumerate(first)}
        self._future = future
        self._masks_of = masks_of

    def __contains__(self, request_id: object) -> bool:
        """Whether the step samples a row of this request under a grammar."""
        return request_id in self._grammars

    def __len__(self) -> int:
        return len(self._grammars)

    def masks_first(self, request_id: str) -> bool:
        """Whether this grammar row's logits are masked before sampling (its bitmask is in
        ``first_bitmask``); the other grammar rows check their pick after (``allows``)."""
        return request_id in self._first

    def first_bitmask(self, request_ids: Sequence[str]) -> torch.Tensor:
        """The next-token bitmask of these masks-first rows, in this order: int32
        [len, ceil(vocab / 32)] (``structured.grammar.fill_masks``; bit set: allowed). Waits
        for the worker thread; the tensor is shared, not to be written."""
        assert self._future is not None, "no row of this step masks first"
        bitmask = self._future.result()
        index = [self._first[request_id] for request_id in request_ids]
        if index == list(range(bitmask.shape[0])):
            return bitmask
        return bitmask[torch.tensor(index)]

    def allows(self, request_id: str, token_id: int) -> bool:
        """Whether this row's grammar takes ``token_id`` next (its state does not change)."""
        return self._grammars[request_id].allows(token_id)

    def allowed(self, request_ids: Sequence[str], vocab_size: int) -> torch.Tensor:
        """The tokens these rows' grammars take next, bool [len, vocab_size] (True: allowed),
        computed now on the caller's thread (rows that do not mask first: their worker bitmask
        does not exist). Waits for the worker first: the two never compute masks at once."""
        self.wait()
        return self._masks_of([self._grammars[request_id] for request_id in request_ids], vocab_size)

    def wait(self) -> None:
        """Return once the worker thread is done with this step's grammars (before anything
        advances them)."""
        if self._future is not None:
            self._future.result()


class StepMasks:
    """The engine's: starts each step's ``GrammarMasks`` before the runner executes it.

    ``vocab_size``: the width of the masks (the model's vocabulary, as the compiler's
    tokenizer); ``fill(grammars, vocab_size)``: the int32 bitmask of those grammars, run on a
    worker thread (``structured.grammar.fill_masks``; llguidance releases the GIL).
    ``masks_of``: passed to each ``GrammarMasks``."""

    def __init__(self, vocab_size: int, fill: Callable[[list, int], torch.Tensor] = fill_masks,
                 masks_of: Callable[[list, int], torch.Tensor] = allowed_masks) -> None:
        self.vocab_size = vocab_size
        self._fill = fill
        self._masks_of = masks_of
        self._pool: ThreadPoolExecutor | None = None

    def start(self, output: SchedulerOutput, requests: Mapping[str, Any]) -> GrammarMasks | None:
        """The step's grammar rows: every sampled row of ``output`` whose request (looked up in
        ``requests``, objects with a ``grammar`` attribute: ``Scheduler.requests``) has a
        grammar. Starts the bitmask of those whose grammar masks first on the worker thread
        and returns at once; None when no sampled row has a grammar (nothing to do)."""
        grammars = {}
        for seq in output.seqs:
            request = requests.get(seq.request_id) if seq.sample else None
            grammar = getattr(request, "grammar", None)
            if grammar is not None:
                assert not seq.num_drafts, "a grammar row never carries drafts"
                grammars[seq.request_id] = grammar
        if not grammars:
            return None
        first = [request_id for request_id, grammar in grammars.items() if grammar.masks_first]
        future = None
        if first:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="hyprefix-grammar")
            future = self._pool.submit(self._fill, [grammars[request_id] for request_id in first], self.vocab_size)
        return GrammarMasks(grammars, first, future, self._masks_of)

    def close(self) -> None:
        """Stop the worker thread (a later ``start`` makes a new one)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
