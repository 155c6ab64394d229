"""Offline API: ``LLM(model=...).generate(prompts, params)`` with a tqdm progress bar."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Sequence
from dataclasses import replace

import torch
from tqdm.auto import tqdm

from hyprefix.config import EngineArgs
from hyprefix.engine import Engine, PromptInput
from hyprefix.openmp import release_workers
from hyprefix.outputs import RequestOutput
from hyprefix.sampling import SamplingParams
from hyprefix.scheduling_policy import check_priority
from hyprefix.text import ChatPrompt


class LLM:
    def __init__(self, model: str | None = None, **kwargs) -> None:
        unknown = set(kwargs) - set(EngineArgs.field_names())
        if unknown:
            raise TypeError(f"unknown LLM arguments: {sorted(unknown)}")
        self.engine = Engine(EngineArgs(model=model, **kwargs))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        ``priority`` (vLLM's): one per prompt, for ``scheduling_policy="priority"`` (lower
        first; it sets each prompt's ``SamplingParams.priority``). All prompts are validated
        before any is queued, so a bad one raises ValueError and leaves the engine untouched.
        """
        if isinstance(prompts, str | dict) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        try:
            prompts = list(prompts)
        except TypeError:
            raise ValueError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}") from None
        if params is None or isinstance(params, SamplingParams):
            params_list = [params or SamplingParams()] * len(prompts)
        else:
            params_list = list(params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        for p in params_list:
            if not isinstance(p, SamplingParams):
                raise ValueError(f"params must be SamplingParams, got {type(p).__name__}")
        if priority is not None:
            priority = list(priority)
            if len(priority) != len(prompts):
                raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
            params_list = [replace(p, priority=q) for p, q in zip(params_list, priority, strict=True)]
        for p in params_list:
            check_priority(self.engine.args.scheduling_policy, p.priority)
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        self.engine.add_requests(list(zip(ids, prompts, params_list, strict=True)))
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template (or ``chat_template``) to one conversation or a
        list of them, with vLLM's arguments (``text.ChatPrompt``), and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.encode_chat(ChatPrompt(
            c, tools, add_generation_prompt, continue_final_message, chat_template, dict(chat_template_kwargs or {})))}
            for c in conversations]
        return self.generate(prompts, params, use_tqdm)

    def encode_chat(self, messages: list[dict] | ChatPrompt, add_generation_prompt: bool = True) -> list[int]:
        return self.engine.encode_chat(messages, add_generation_prompt)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm, unit="req")
        try:
            while len(done) < len(ids):
                outputs = self.engine.step()
                if not outputs and not self.engine.has_unfinished_sequences():
                    raise RuntimeError(f"engine went idle with {len(ids) - len(done)} requests unfinished")
                for out in outputs:
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for request_id in wanted - set(done):
                self.engine.abort(request_id)
            raise
        finally:
            bar.close()
            # The next call may come from another thread: leave no OpenMP pool behind (``openmp.py``).
            release_workers()
        return [done[i] for i in ids]

    def update_weights(self, weights: str | os.PathLike | Iterable[tuple[str, torch.Tensor]],
                       weight_version: str | None = None) -> dict[str, object]:
        """New weights for the model, in place (``Engine.update_weights``): a checkpoint
        directory or GGUF file of the same architecture, or (name, tensor) pairs with the
        checkpoint's names, e.g. a trainer's ``state_dict().items()``. Blocks cached under
        the old weights are never hit again. Returns the new ``weight_version``, the number
        of parameters and the seconds it took."""
        return self.engine.update_weights(weights, weight_version)

    @property
    def weight_version(self) -> str:
        return self.engine.weight_version

    def get_stats(self) -> dict[str, int | float]:
        return self.engine.get_stats()

    def reset_prefix_cache(self) -> int:
        """Drop every cached block no running request holds; returns how many were dropped."""
        return self.engine.reset_prefix_cache()

    def check_invariants(self) -> None:
        self.engine.check_invariants()
