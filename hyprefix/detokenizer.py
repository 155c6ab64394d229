"""Incremental detokenization and stop-string matching for one sequence."""

from __future__ import annotations

from collections.abc import Callable

# Prompt tokens kept as left context so the first generated tokens decode with the
# spacing they have in the full text (SentencePiece-style tokenizers need this).
_CONTEXT_TOKENS = 6


def text_decoder(tokenizer, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> Callable[[list[int]], str]:
    """``tokenizer.decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)``
    (and ``spaces_between_special_tokens``, which only slow tokenizers read).

    For a transformers fast tokenizer that overrides neither ``decode`` nor ``_decode``, that call
    is exactly its ``tokenizers`` backend's ``decode(ids, skip_special_tokens=...)``; calling the
    backend directly skips transformers' argument handling, twice per generated token."""
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

    backend = getattr(tokenizer, "_tokenizer", None)
    cls = type(tokenizer)
    if (backend is not None and isinstance(tokenizer, PreTrainedTokenizerFast)
            and cls.decode is PreTrainedTokenizerBase.decode and cls._decode is PreTrainedTokenizerFast._decode):
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    kwargs = {"skip_special_tokens": skip_special_tokens, "clean_up_tokenization_spaces": False}
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        kwargs["spaces_between_special_tokens"] = spaces_between_special_tokens
    return lambda ids: tokenizer.decode(ids, **kwargs)


class IncrementalDetokenizer:
    """Turns generated token ids into text, never emitting a broken UTF-8 character.

    Text is only extended when the decoded tail does not end in U+FFFD (a partial
    multi-byte character). ``stop`` strings end the text before the match (after it with
    ``include_stop``); while
    running, ``visible_text`` holds back the last ``max(len(stop)) - 1`` characters
    so a stream never shows the start of a stop string it later removes.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: tuple[str, ...],
                 decode: Callable[[list[int]], str] | None = None, include_stop: bool = False) -> None:
        """``decode``: ``text_decoder(tokenizer)``, when the caller keeps one for many sequences."""
        self._decode = decode or text_decoder(tokenizer)
        context = prompt_token_ids[-_CONTEXT_TOKENS:]
        self._ids: list[int] = list(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.text = ""
        self.stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.include_stop = include_stop

    def append(self, token_id: int, check_stop: bool = True) -> str | None:
        """Add one token; returns the stop string that matched, if any (text is cut there).
        ``check_stop`` False: no stop string ends the text yet (``min_tokens``)."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return None
        delta = new_text[len(prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self.text += delta
        if not self.stop or not check_stop:
            return None
        search_from = max(0, len(self.text) - len(delta) - self._hold)
        best: tuple[int, str] | None = None
        for s in self.stop:
            at = self.text.find(s, search_from)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, s)
        if best is None:
            return None
        self.text = self.text[:best[0] + (len(best[1]) if self.include_stop else 0)]
        return best[1]

    def visible_text(self, finished: bool) -> str:
        if finished or self._hold == 0:
            return self.text
        return self.text[: max(0, len(self.text) - self._hold)]
