"""The engine's logprobs (``outputs.PositionLogprobs``) in OpenAI's response shapes:
completions' ``CompletionLogprobs`` (tokens by text, offsets) and chat's ``ChatLogprobs``
(tokens with their UTF-8 bytes); vLLM's ``prompt_logprobs``. A log-probability of -inf
(a token masked out) is sent as -9999.0, as vLLM does: JSON has no infinity."""

from __future__ import annotations

import math
from collections.abc import Sequence

from hyprefix.outputs import PositionLogprobs
from hyprefix.server.responses import PromptLogprob

NEG_INF_LOGPROB = -9999.0


def _finite(value: float) -> float:
    return value if math.isfinite(value) else NEG_INF_LOGPROB


def _text(token_id: int, entry: PositionLogprobs) -> str:
    return entry[token_id].decoded_token or ""


def completion_logprobs(token_ids: Sequence[int], entries: Sequence[PositionLogprobs | None],
                        text_offset: int = 0) -> dict[str, list]:
    """Completions' logprobs of ``token_ids`` (one entry each, as the engine made it with the
    request's top count; None for a prompt's first token); offsets counted from ``text_offset``.
    Plain data in ``CompletionLogprobs``' shape: a stream chunk sends it as it is."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offsets: list[int] = []
    offset = text_offset
    for token_id, entry in zip(token_ids, entries, strict=True):
        text_offsets.append(offset)
        if entry is None:  # the prompt's first token has no logprob (OpenAI: null)
            tokens.append("")
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        text = _text(token_id, entry)
        tokens.append(text)
        token_logprobs.append(_finite(entry[token_id].logprob))
        # the sampled token and the top ones (OpenAI: up to logprobs + 1 entries), by text
        top: dict[str, float] = {}
        for logprob in entry.values():
            top.setdefault(logprob.decoded_token or "", _finite(logprob.logprob))
        top_logprobs.append(top)
        offset += len(text)
    return {"text_offset": text_offsets, "token_logprobs": token_logprobs, "tokens": tokens,
            "top_logprobs": top_logprobs}


def chat_logprobs(token_ids: Sequence[int], entries: Sequence[PositionLogprobs], num_top: int) -> dict[str, list]:
    """Chat's logprobs of ``token_ids``: each token with its bytes and ``num_top`` top ones.
    Plain data in ``ChatLogprobs``' shape: a stream chunk sends it as it is."""
    content = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        text = _text(token_id, entry)
        top = sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= num_top),
                     key=lambda lp: lp.rank)
        content.append({
            "token": text, "logprob": _finite(entry[token_id].logprob), "bytes": list(text.encode("utf-8")),
            "top_logprobs": [{"token": lp.decoded_token or "", "logprob": _finite(lp.logprob),
                              "bytes": list((lp.decoded_token or "").encode("utf-8"))} for lp in top]})
    return {"content": content}


def prompt_logprobs(entries: Sequence[PositionLogprobs | None] | None) -> list[dict[int, PromptLogprob] | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or token id -> entry."""
    if entries is None:
        return None
    return [None if entry is None else {
        t: PromptLogprob(logprob=_finite(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token)
        for t, lp in entry.items()} for entry in entries]
