"""The input processor: a request's prompt and parameters checked and made ready before anything is
queued or allocated (tokenizing, truncation, validation against the model and the pool, bad words
as token ids, structured outputs compiled). Every user error is a ``RequestError``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hyprefix.errors import RequestError
from hyprefix.sampling import SamplingParams
from hyprefix.structured.grammar import GrammarCompiler
from hyprefix.text import ChatPrompt, chat_token_ids, check_text

PromptInput = str | list[int] | dict


@dataclass(frozen=True)
class Prepared:
    """One request ready to queue: its parameters (bad words resolved), prompt text (None for
    token ids), token ids and cache salt."""

    params: SamplingParams
    text: str | None
    ids: list[int]
    salt: str | None


class InputProcessor:
    """``pool_tokens``: (blocks, tokens) the KV pool holds now (a request must fit in it whole)."""

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, max_logprobs: int,
                 grammars: GrammarCompiler, pool_tokens: Callable[[], tuple[int, int]]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs
        self.grammars = grammars
        self.pool_tokens = pool_tokens

    def prepare(self, prompt: PromptInput, params: SamplingParams) -> Prepared:
        """Tokenize, truncate (``truncate_prompt_tokens``, vLLM's: the last k tokens), validate, resolve
        bad words and compile the structured output (a bad one raises here, before anything is queued)."""
        text, ids, salt = self.tokenize_prompt(prompt)
        if params.truncate_prompt_tokens is not None:
            keep = self.max_model_len if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
            ids = ids[-keep:]
        self.validate(ids, params)
        if params.bad_words:
            params = params.with_bad_words_ids(self.bad_words_ids(params.bad_words))
        if params.structured_outputs is not None:
            self.grammars.compile(params.structured_outputs)
        return Prepared(params, text, ids, salt)

    def encode_chat(self, messages: list[dict] | ChatPrompt, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation (or a ``ChatPrompt``) under the tokenizer's chat template;
        bad input raises RequestError (``text.chat_token_ids``)."""
        return chat_token_ids(self.tokenizer, messages, add_generation_prompt)

    def tokenize_prompt(self, prompt: PromptInput) -> tuple[str | None, list[int], str | None]:
        """(text, token ids, cache salt) of one prompt; raises RequestError on bad input."""
        salt = None
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"}
            if unknown:
                raise RequestError(f"unknown prompt keys {sorted(unknown)}", param="prompt")
            salt = prompt.get("cache_salt")
            if salt is not None and not isinstance(salt, str):
                raise RequestError("cache_salt must be a string", param="cache_salt")
            if salt is not None:
                check_text(salt, "cache_salt", param="cache_salt")
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise RequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'", param="prompt")
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("the prompt is empty", param="prompt")
            check_text(prompt, "the prompt", param="prompt")
            return prompt, list(self.tokenizer.encode(prompt)), salt
        if isinstance(prompt, list | tuple):
            ids = list(prompt)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise RequestError("prompt token ids must be integers", param="prompt")
            return None, ids, salt
        raise RequestError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}",
                           param="prompt")

    def bad_words_ids(self, words: list[str]) -> tuple[tuple[int, ...], ...]:
        """Each bad word's token ids, as vLLM: the word alone and after a space (the form it
        takes inside a text), each distinct sequence once."""
        out: dict[tuple[int, ...], None] = {}
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                if ids:
                    out[ids] = None
        return tuple(out)

    def validate(self, ids: list[int], params: SamplingParams) -> None:
        """Raise ``RequestError`` unless the prompt ``ids`` with ``params`` can ever run here."""
        if not ids:
            raise RequestError("the prompt is empty", param="prompt")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                               param="prompt")
        for param, token_ids in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids",
                                                                           params.allowed_token_ids or ())):
            outside = [t for t in token_ids if not 0 <= t < self.vocab_size]
            if outside:
                raise RequestError(f"{param}: token id {outside[0]} is outside the vocabulary [0, {self.vocab_size})",
                                   param=param)
        limit = self.max_logprobs
        for param in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, param)
            if asked is not None and limit != -1 and (asked == -1 or asked > limit):
                raise RequestError(f"{param}={asked} is more than this server's limit of {limit} (--max-logprobs)",
                                   param=param)
        too_long = "context_length_exceeded"
        if len(ids) > self.max_model_len:
            raise RequestError(f"the prompt has {len(ids)} tokens, more than max_model_len={self.max_model_len}",
                               param="prompt", code=too_long)
        total = len(ids) + params.max_tokens
        if total > self.max_model_len:
            raise RequestError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                               f"max_model_len={self.max_model_len}", param="prompt", code=too_long)
        blocks, pool = self.pool_tokens()
        if total > pool:
            raise RequestError(f"prompt + max_tokens = {total} tokens can never fit in the KV pool "
                               f"({blocks} blocks = {pool} tokens)", param="prompt", code=too_long)
