"""Greedy / temperature / min-p / top-k / top-p sampling with per-request seeds, after
the logits processing requests ask for (``logits.py``), and their logprobs.

Random rows use the exponential-race trick: ``argmax(p / E)`` with ``E ~ Exp(1)``
draws from ``p``. A seeded request draws its noise from its own generator, so its
tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

import torch

from hyprefix.outputs import PositionLogprobs, ScheduledSeq
from hyprefix.runner.logits import LogitsProcessor, logprobs_of
from hyprefix.structured.grammar import apply_masks


class Sampler:
    def __init__(self, seed: int, device: torch.device, eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._request_generators: dict[str, torch.Generator] = {}
        self.processor = LogitsProcessor(device, eos_token_ids)

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._request_generators.pop(request_id, None)
        self.processor.forget(request_ids)

    def sample(self, logits: torch.Tensor, seqs: list[ScheduledSeq], greedy: torch.Tensor | None = None,
               grammar_masks: tuple[list[int], torch.Tensor] | None = None
               ) -> tuple[list[int], dict[int, PositionLogprobs]]:
        """logits: float32 [S, V], one row per entry of ``seqs``; ``greedy``: their argmax
        [S] where the caller has it already (a compiled decode step); ``grammar_masks``: the
        rows with a structured-outputs grammar and their next-token bitmask (computed beside
        the forward pass). Each such row's token is sampled from what its grammar allows and
        advances it. Returns the sampled tokens and, for the rows whose requests ask, their
        logprobs (of the raw logits) by row."""
        raw = logits
        grammar_rows = grammar_masks[0] if grammar_masks is not None else []
        processed = sorted(set(grammar_rows) | {i for i, s in enumerate(seqs) if s.params.processes_logits})
        if processed:
            rows = torch.tensor(processed, device=logits.device)
            logits = logits.clone()
            if grammar_masks is not None:
                masked = torch.tensor(grammar_rows, device=logits.device)
                sub = logits[masked]
                apply_masks(sub, grammar_masks[1])
                logits[masked] = sub
            chosen = [i for i in processed if seqs[i].params.processes_logits]
            if chosen:
                index = torch.tensor(chosen, device=logits.device)
                logits[index] = self.processor.apply(logits[index], [seqs[i] for i in chosen])
            if greedy is not None:
                greedy = greedy.clone()
                greedy[rows] = logits[rows].argmax(dim=-1)
        tokens = logits.argmax(dim=-1) if greedy is None else greedy
        random_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            probs = self._probs(logits[rows], [seqs[i] for i in random_rows])
            noise = torch.empty_like(probs)
            unseeded = [j for j, i in enumerate(random_rows) if seqs[i].params.seed is None]
            if unseeded:
                noise[unseeded] = torch.empty(
                    len(unseeded), probs.shape[1], device=probs.device).exponential_(generator=self.generator)
            for j, i in enumerate(random_rows):
                if seqs[i].params.seed is not None:
                    noise[j].exponential_(generator=self._generator_for(seqs[i]))
            tokens[rows] = (probs / noise).argmax(dim=-1)
        token_list = tokens.tolist()
        for i in grammar_rows:
            seqs[i].grammar.accept(token_list[i])
        asking = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        if not asking:
            return token_list, {}
        rows = torch.tensor(asking, device=logits.device)
        entries = logprobs_of(raw[rows], tokens[rows], [seqs[i].params.logprobs for i in asking])
        return token_list, dict(zip(asking, entries, strict=True))

    def _generator_for(self, seq: ScheduledSeq) -> torch.Generator:
        gen = self._request_generators.get(seq.request_id)
        if gen is None:
            assert seq.params.seed is not None
            gen = torch.Generator(device=self.device).manual_seed(seq.params.seed)
            self._request_generators[seq.request_id] = gen
        return gen

    @staticmethod
    def _probs(logits: torch.Tensor, seqs: list[ScheduledSeq]) -> torch.Tensor:
        temps = torch.tensor([s.params.temperature for s in seqs], device=logits.device)
        logits = logits / temps[:, None]
        min_ps = [s.params.min_p for s in seqs]
        if any(min_ps):
            probs = logits.softmax(dim=-1)
            floor = probs.amax(dim=-1, keepdim=True) * torch.tensor(min_ps, device=logits.device)[:, None]
            logits = logits.masked_fill(probs < floor, float("-inf"))
        top_ks = [s.params.top_k for s in seqs]
        vocab = logits.shape[1]
        if any(0 < k < vocab for k in top_ks):
            ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks], device=logits.device)
            sorted_desc = logits.sort(dim=-1, descending=True).values
            kth = sorted_desc.gather(1, (ks - 1)[:, None])
            logits = logits.masked_fill(logits < kth, float("-inf"))
        top_ps = [s.params.top_p for s in seqs]
        if any(p < 1.0 for p in top_ps):
            ps = torch.tensor(top_ps, device=logits.device)
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            sorted_probs = sorted_logits.softmax(dim=-1)
            before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly above each token
            drop_sorted = before > ps[:, None]  # the top token always has 0 before it: kept
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        return logits.softmax(dim=-1)
