"""The engine's logprobs (``outputs.PositionLogprobs``) in OpenAI's response shapes:
completions' ``CompletionLogprobs`` (tokens by text, offsets) and chat's ``ChatLogprobs``
(tokens with their UTF-8 bytes); vLLM's ``prompt_logprobs``. A log-probability of -inf
(a token masked out) is sent as -9999.0, as vLLM does: JSON has no infinity."""

from __future__ import annotations

import math
from collections.abc import Sequence

from hyprefix.outputs import PositionLogprobs
from hyprefix.server.protocol import ChatLogprobs, CompletionLogprobs, PromptLogprob, TokenLogprob, TopLogprob

NEG_INF_LOGPROB = -9999.0


def _finite(value: float) -> float:
    return value if math.isfinite(value) else NEG_INF_LOGPROB


def _text(token_id: int, entry: PositionLogprobs) -> str:
    return entry[token_id].decoded_token or ""


def completion_logprobs(token_ids: Sequence[int], entries: Sequence[PositionLogprobs | None],
                        text_offset: int = 0) -> CompletionLogprobs:
    """Completions' logprobs of ``token_ids`` (one entry each, as the engine made it with the
    request's top count; None for a prompt's first token); offsets counted from ``text_offset``."""
    out = CompletionLogprobs()
    offset = text_offset
    for token_id, entry in zip(token_ids, entries, strict=True):
        if entry is None:  # the prompt's first token has no logprob (OpenAI: null)
            out.tokens.append("")
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            out.text_offset.append(offset)
            continue
        text = _text(token_id, entry)
        out.tokens.append(text)
        out.token_logprobs.append(_finite(entry[token_id].logprob))
        # the sampled token and the top ones (OpenAI: up to logprobs + 1 entries), by text
        top: dict[str, float] = {}
        for logprob in entry.values():
            top.setdefault(logprob.decoded_token or "", _finite(logprob.logprob))
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(text)
    return out


def chat_logprobs(token_ids: Sequence[int], entries: Sequence[PositionLogprobs], num_top: int) -> ChatLogprobs:
    """Chat's logprobs of ``token_ids``: each token with its bytes and ``num_top`` top ones."""
    content = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        text = _text(token_id, entry)
        top = sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= num_top),
                     key=lambda item: item[1].rank)
        content.append(TokenLogprob(
            token=text, logprob=_finite(entry[token_id].logprob), bytes=list(text.encode("utf-8")),
            top_logprobs=[TopLogprob(token=lp.decoded_token or "", logprob=_finite(lp.logprob),
                                     bytes=list((lp.decoded_token or "").encode("utf-8"))) for _, lp in top]))
    return ChatLogprobs(content=content)


def prompt_logprobs(entries: Sequence[PositionLogprobs | None] | None) -> list[dict[int, PromptLogprob] | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or token id -> entry."""
    if entries is None:
        return None
    return [None if entry is None else {
        t: PromptLogprob(logprob=_finite(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token)
        for t, lp in entry.items()} for entry in entries]
