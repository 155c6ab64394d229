"""Verification of speculative drafts (``speculative.py``): the rows that sample after each of a
row's tokens, and which drafts stand.

A row carrying k drafts samples k + 1 times, position i from the model's distribution given the
context and the first i drafts: ``sample_rows`` makes those as one-token rows whose output so far
includes the drafts before them, so every logits processor (penalties, bad words, ``min_tokens``)
and the sampler see exactly the history a step without drafts would have shown them.

``accept`` keeps the drafts that equal the token sampled before them, then that first differing
(or the bonus) token. For greedy rows this is the argmax chain a step-by-step decode makes. For
random rows it is rejection sampling with a one-token draft distribution: the draft d is kept with
probability p(d), and on a refusal the token sampled is distributed as p given "not d", which is
the residual max(p - q, 0) normalised; so the output distribution is unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from hyprefix.outputs import ScheduledSeq


def sample_rows(seq: ScheduledSeq) -> list[ScheduledSeq]:
    """One single-token row per token of a row with drafts, in order: row i computes the token at
    ``start_pos + i`` and samples with the drafts before it as part of the output so far."""
    k = seq.num_drafts
    drafts = list(seq.token_ids[-k:])
    output = list(seq.output_token_ids)
    return [dataclasses.replace(seq, token_ids=[token], start_pos=seq.start_pos + i, sample=True, num_drafts=0,
                                num_generated=seq.num_generated + i, output_token_ids=output + drafts[:i],
                                state_taps=())
            for i, token in enumerate(seq.token_ids)]


def accept(sampled: Sequence[int], drafts: Sequence[int]) -> int:
    """How many leading drafts stand: ``sampled[i]`` is the token sampled after the row's first
    i drafts, so draft i stands while every earlier one did and ``sampled[i] == drafts[i]``."""
    accepted = 0
    for token, draft in zip(sampled, drafts, strict=False):
        if token != draft:
            break
        accepted += 1
    return accepted
