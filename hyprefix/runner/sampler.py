"""Greedy / temperature / min-p / top-k / top-p sampling with per-request seeds, after
the logits processing requests ask for (``logits.py``), and their logprobs.

A random row draws one uniform ``u`` and takes the token where the cumulative
distribution passes ``u`` (inverse CDF, the sum in float64): one random number a token,
where noise for every vocabulary entry (the exponential race) costs a random number per
entry, which on a CPU cost more than the rest of the step's sampling. A seeded request
draws from its own generator, so its tokens do not depend on what else is in the batch.

Logprobs follow the engine's ``--logprobs-mode`` (vLLM's): "raw_*" read the model's logits,
"processed_*" the distribution each token was drawn from: for a random row the very logits
``_sampling_logits`` makes for the draw (processed, masked, divided by the temperature,
top-k / top-p / min-p filtered to -inf), for a greedy row the logits its argmax read
(processed and masked, no temperature). "*_logprobs" are their log-softmax, "*_logits" the
values themselves. Rows that ask for no logprobs cost nothing more in any mode.
"""

from __future__ import annotations

import torch

from hyprefix.config import LOGPROBS_MODES
from hyprefix.outputs import PositionLogprobs, ScheduledSeq
from hyprefix.runner.logits import LogitsProcessor, logprobs_of
from hyprefix.structured.grammar import apply_masks
from hyprefix.structured.step_masks import GrammarMasks


class Sampler:
    def __init__(self, seed: int, device: torch.device, eos_token_ids: frozenset[int] = frozenset(),
                 logprobs_mode: str = "raw_logprobs") -> None:
        """``logprobs_mode``: one of ``config.LOGPROBS_MODES``. In a processed mode a grammar row
        that asks for logprobs must mask first (``Grammar.masks_first``, the engine's part):
        a row checked after sampling has no mask to read."""
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
        self.processed_logprobs = logprobs_mode.startswith("processed")
        self.logits_values = logprobs_mode.endswith("_logits")
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._request_generators: dict[str, torch.Generator] = {}
        self.processor = LogitsProcessor(device, eos_token_ids)

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._request_generators.pop(request_id, None)
        self.processor.forget(request_ids)

    def sample(self, logits: torch.Tensor, seqs: list[ScheduledSeq], greedy: torch.Tensor | None = None,
               masks: GrammarMasks | None = None) -> tuple[list[int], dict[int, PositionLogprobs]]:
        """logits: float32 [S, V], one row per entry of ``seqs``; ``greedy``: their argmax
        [S] where the caller has it already (a compiled decode step). Returns the sampled
        tokens and, for the rows whose requests ask, their logprobs by row (of the raw or the
        processed logits, by ``logprobs_mode``).

        ``masks``: the step's grammar rows (``structured/step_masks.py``), read only: a row
        with a structured-outputs grammar samples from what its grammar allows; the grammar
        itself advances later, in ``Scheduler.update``. A row whose grammar masks first
        (``GrammarMasks.masks_first``: top-k, top-p and min-p read the masked distribution)
        has its logits masked by the bitmask computed beside the forward pass. The other
        grammar rows check their pick after sampling (``_follow_grammars``): a pick the grammar
        allows stands (for greedy it is the masked argmax; for random rows the result is
        exactly the masked distribution), a refused one is redrawn among the allowed tokens:
        the common case needs no mask at all."""
        raw = logits
        grammar_rows = [i for i, s in enumerate(seqs) if s.request_id in masks] if masks is not None else []
        masked_rows = [i for i in grammar_rows if masks.masks_first(seqs[i].request_id)]
        processed = sorted(set(masked_rows) | {i for i, s in enumerate(seqs) if s.params.processes_logits})
        if processed:
            logits = logits.clone()
            bitmask = masks.first_bitmask([seqs[i].request_id for i in masked_rows]) if masked_rows else None
            if masked_rows and len(masked_rows) == len(seqs):
                apply_masks(logits, bitmask)  # every row: in place, no copies
            elif masked_rows:
                masked = torch.tensor(masked_rows, device=logits.device)
                sub = logits[masked]
                apply_masks(sub, bitmask)
                logits[masked] = sub
            chosen = [i for i in processed if seqs[i].params.processes_logits]
            if chosen:
                index = torch.tensor(chosen, device=logits.device)
                logits[index] = self.processor.apply(logits[index], [seqs[i] for i in chosen])
            changed = [i for i in processed if seqs[i].params.greedy]  # random rows sample below
            if greedy is not None and changed:
                greedy = greedy.clone()
                index = torch.tensor(changed, device=logits.device)
                greedy[index] = logits[index].argmax(dim=-1)
        tokens = logits.argmax(dim=-1) if greedy is None else greedy
        random_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        probs = sampled_from = None
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            sampled_from = self._sampling_logits(logits[rows], [seqs[i] for i in random_rows])
            probs = sampled_from.softmax(dim=-1)
            tokens[rows] = self._inverse_cdf(probs, [seqs[i] for i in random_rows])
        token_list = tokens.tolist()
        checked = [i for i in grammar_rows if not masks.masks_first(seqs[i].request_id)]
        if checked:
            self._follow_grammars(checked, masks, seqs, token_list, logits, probs,
                                  {i: j for j, i in enumerate(random_rows)})
            tokens = torch.tensor(token_list, device=logits.device)
        asking = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        if not asking:
            return token_list, {}
        num_top = [seqs[i].params.logprobs for i in asking]
        if self.processed_logprobs:
            source = self._processed_rows(logits, sampled_from, asking, random_rows)
            chosen = tokens if len(asking) == len(seqs) else tokens[torch.tensor(asking, device=logits.device)]
            entries = logprobs_of(source, chosen, num_top, self.logits_values)
        elif len(asking) == len(seqs):  # every row: no copies
            entries = logprobs_of(raw, tokens, num_top, self.logits_values)
        else:
            rows = torch.tensor(asking, device=logits.device)
            entries = logprobs_of(raw[rows], tokens[rows], num_top, self.logits_values)
        return token_list, dict(zip(asking, entries, strict=True))

    @staticmethod
    def _processed_rows(logits: torch.Tensor, sampled_from: torch.Tensor | None, asking: list[int],
                        random_rows: list[int]) -> torch.Tensor:
        """The distributions the rows ``asking`` were sampled from, as logits [len(asking), V]:
        a random row's row of ``sampled_from`` (``_sampling_logits`` of ``random_rows``), a
        greedy row's row of ``logits`` (after processing and masks). Reads what sampling
        made; copies only where the asking rows are not already one tensor."""
        if sampled_from is not None and asking == random_rows:
            return sampled_from
        random_row = {i: j for j, i in enumerate(random_rows)}
        drawn = [k for k, i in enumerate(asking) if i in random_row]
        if not drawn and len(asking) == logits.shape[0]:
            return logits
        source = logits[torch.tensor(asking, device=logits.device)]
        if drawn:
            source[drawn] = sampled_from[[random_row[asking[k]] for k in drawn]]
        return source

    def _draws(self, seqs: list[ScheduledSeq]) -> torch.Tensor:
        """One uniform in [0, 1) per sequence, float64 [len]: from the request's own generator
        where it has a seed, else the sampler's (in row order)."""
        draws = torch.empty(len(seqs), dtype=torch.float64)
        unseeded = [j for j, s in enumerate(seqs) if s.params.seed is None]
        if unseeded:
            draws[unseeded] = torch.rand(len(unseeded), dtype=torch.float64, generator=self.generator)
        for j, seq in enumerate(seqs):
            if seq.params.seed is not None:
                draws[j] = float(torch.rand(1, dtype=torch.float64, generator=self._generator_for(seq)))
        return draws

    def _search(self, weights: torch.Tensor, seqs: list[ScheduledSeq]) -> torch.Tensor:
        """Per row of ``weights`` [R, V] (unnormalised probabilities), the first entry where their
        float64 cumulative sum passes ``u`` times its total, ``u`` the row's draw (``_draws``); V
        where ``u`` times the total rounded up to the total (or the row is all zero)."""
        cdf = weights.cumsum(dim=-1, dtype=torch.float64)
        targets = (self._draws(seqs).to(cdf.device) * cdf[:, -1])[:, None]
        return torch.searchsorted(cdf, targets, right=True)[:, 0]  # first entry past the target: p > 0

    def _inverse_cdf(self, probs: torch.Tensor, seqs: list[ScheduledSeq]) -> torch.Tensor:
        """One token per row of ``probs`` [R, V] (``_search``; the most likely token where it
        rounds up to the end)."""
        picks = self._search(probs, seqs)
        return torch.where(picks >= probs.shape[1], probs.argmax(dim=-1), picks)

    def _follow_grammars(self, rows: list[int], masks: GrammarMasks, seqs: list[ScheduledSeq], tokens: list[int],
                         logits: torch.Tensor, probs: torch.Tensor | None, random_row: dict[int, int]) -> None:
        """Hold the token of each grammar row in ``rows`` (those not masked first) to its
        grammar, in place in ``tokens``; the grammar is only read (``masks``), never advanced.
        A row whose pick the grammar refuses takes, among its allowed tokens, the most likely
        (greedy) or a new draw by their probabilities (random). The random case samples the
        masked distribution exactly: an allowed ``t`` comes first-time with probability
        p(t), else after a refusal with (1 - p(A)) p(t) / p(A), in all p(t) / p(A). The
        refused rows' masks are computed in one call, their picks made on tensors."""
        refused = [i for i in rows if not masks.allows(seqs[i].request_id, tokens[i])]
        if refused:
            vocab = logits.shape[1]
            allowed = masks.allowed([seqs[i].request_id for i in refused], vocab).to(logits.device)
            some = allowed.any(dim=-1).tolist()  # a row allowing nothing keeps its pick: the parser fails
            drawn = [k for k, i in enumerate(refused) if some[k] and i in random_row]
            if drawn:
                weights = probs[[random_row[refused[k]] for k in drawn]] * allowed[drawn]
                picks = self._search(weights, [seqs[refused[k]] for k in drawn])
                for k, token in zip(drawn, picks.tolist(), strict=True):
                    tokens[refused[k]] = token
            # greedy rows, and drawn ones where u x total rounded up to the total (or no allowed
            # token had p > 0): the most likely allowed token
            best = [k for k, i in enumerate(refused) if some[k] and (i not in random_row or tokens[i] >= vocab)]
            if best:
                rows_best = logits[[refused[k] for k in best]].masked_fill(~allowed[best], float("-inf"))
                for k, token in zip(best, rows_best.argmax(dim=-1).tolist(), strict=True):
                    tokens[refused[k]] = token

    def _generator_for(self, seq: ScheduledSeq) -> torch.Generator:
        gen = self._request_generators.get(seq.request_id)
        if gen is None:
            assert seq.params.seed is not None
            gen = torch.Generator(device=self.device).manual_seed(seq.params.seed)
            self._request_generators[seq.request_id] = gen
        return gen

    @staticmethod
    def _sampling_logits(logits: torch.Tensor, seqs: list[ScheduledSeq]) -> torch.Tensor:
        """Random rows' logits [R, V] as drawn from (their softmax): divided by each row's
        temperature, then min-p, top-k and top-p set what they drop to -inf. The one
        definition of the sampled distribution: the draw and processed logprobs both read it."""
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
        return logits
