"""Logits processing before sampling (``SamplingParams.processes_logits``), and logprobs.

``LogitsProcessor.apply`` changes the rows of the requests that ask for it, all rows at
once on tensors: the per-request Python work is over each request's own lists (its bias
entries, bad words, history), never over the vocabulary. Requests that ask for nothing
cost nothing. The order is vLLM's: allowed token ids, bad words, min_tokens, logit bias,
then the repetition, frequency and presence penalties.

Logprobs (``logprobs_of``) are log-softmax of float32 logits: by default the model's before
any processing (vLLM's default "raw_logprobs"); the sampler passes the processed ones, or asks
for the logit values themselves, by ``--logprobs-mode`` (``sampler.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyprefix.outputs import Logprob, ScheduledSeq


@dataclass
class _RowTensors:
    """What a request's processing needs every step, built once for it."""

    allowed: torch.Tensor | None  # long ids
    bias_ids: torch.Tensor | None
    bias_values: torch.Tensor | None
    prompt_ids: torch.Tensor | None  # the prompt's distinct ids (repetition penalty)


class LogitsProcessor:
    def __init__(self, device: torch.device, eos_token_ids: frozenset[int]) -> None:
        self.device = device
        self.eos_token_ids = eos_token_ids
        self._rows: dict[str, _RowTensors] = {}

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._rows.pop(request_id, None)

    def _row(self, seq: ScheduledSeq) -> _RowTensors:
        row = self._rows.get(seq.request_id)
        if row is None:
            params, device = seq.params, self.device
            bias = params.logit_bias or {}
            row = _RowTensors(
                torch.tensor(sorted(set(params.allowed_token_ids)), device=device)
                if params.allowed_token_ids else None,
                torch.tensor(list(bias), dtype=torch.long, device=device) if bias else None,
                torch.tensor(list(bias.values()), dtype=torch.float32, device=device) if bias else None,
                torch.tensor(sorted(set(seq.prompt_token_ids)), dtype=torch.long, device=device)
                if params.repetition_penalty != 1.0 else None)
            self._rows[seq.request_id] = row
        return row

    def apply(self, logits: torch.Tensor, seqs: list[ScheduledSeq]) -> torch.Tensor:
        """``logits`` float32 [R, V], one row per entry of ``seqs`` (each ``processes_logits``);
        returns the processed rows (``logits`` itself, changed in place)."""
        vocab = logits.shape[1]
        rows = [self._row(seq) for seq in seqs]
        allowed = [(i, row.allowed) for i, row in enumerate(rows) if row.allowed is not None]
        if allowed:
            keep = torch.zeros(len(allowed), vocab, dtype=torch.bool, device=logits.device)
            for j, (_, ids) in enumerate(allowed):
                keep[j, ids] = True
            index = torch.tensor([i for i, _ in allowed], device=logits.device)
            logits[index] = logits[index].masked_fill(~keep, float("-inf"))
        banned_rows: list[int] = []
        banned_ids: list[int] = []
        for i, seq in enumerate(seqs):
            params, out = seq.params, seq.output_token_ids
            for word in params.bad_words_token_ids:
                prefix = word[:-1]
                if not prefix or tuple(out[len(out) - len(prefix):]) == prefix:
                    banned_rows.append(i)
                    banned_ids.append(word[-1])
            if seq.num_generated < params.min_tokens:
                stops = params.stop_token_set if params.ignore_eos else params.stop_token_set | self.eos_token_ids
                banned_rows.extend([i] * len(stops))
                banned_ids.extend(stops)
        if banned_rows:
            logits[banned_rows, banned_ids] = float("-inf")
        biased = [(i, row) for i, row in enumerate(rows) if row.bias_ids is not None]
        for i, row in biased:
            logits[i].index_add_(0, row.bias_ids, row.bias_values)
        self._penalize(logits, seqs, rows)
        return logits

    def _penalize(self, logits: torch.Tensor, seqs: list[ScheduledSeq], rows: list[_RowTensors]) -> None:
        vocab = logits.shape[1]
        device = logits.device
        repeat = [i for i, seq in enumerate(seqs) if seq.params.repetition_penalty != 1.0]
        if repeat:
            seen = torch.zeros(len(repeat), vocab, dtype=torch.bool, device=device)
            for j, i in enumerate(repeat):
                seen[j, rows[i].prompt_ids] = True
                if seqs[i].output_token_ids:
                    seen[j, torch.tensor(seqs[i].output_token_ids, dtype=torch.long, device=device)] = True
            index = torch.tensor(repeat, device=device)
            penalty = torch.tensor([seqs[i].params.repetition_penalty for i in repeat], device=device)[:, None]
            sub = logits[index]
            penalized = torch.where(sub > 0, sub / penalty, sub * penalty)
            logits[index] = torch.where(seen, penalized, sub)
        counted = [i for i, seq in enumerate(seqs) if (seq.params.frequency_penalty or seq.params.presence_penalty)
                   and seq.output_token_ids]
        if counted:
            outputs = [seqs[i].output_token_ids for i in counted]
            width = max(len(o) for o in outputs)
            padded = torch.full((len(counted), width), vocab, dtype=torch.long, device=device)
            for j, out in enumerate(outputs):
                padded[j, :len(out)] = torch.tensor(out, dtype=torch.long, device=device)
            counts = torch.zeros(len(counted), vocab + 1, device=device).scatter_add_(
                1, padded, torch.ones(padded.shape, device=device))[:, :vocab]
            frequency = torch.tensor([seqs[i].params.frequency_penalty for i in counted], device=device)[:, None]
            presence = torch.tensor([seqs[i].params.presence_penalty for i in counted], device=device)[:, None]
            index = torch.tensor(counted, device=device)
            logits[index] -= frequency * counts + presence * (counts > 0)


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor, num_top: list[int],
                values: bool = False) -> list[dict[int, Logprob]]:
    """For each row of float32 ``logits`` [R, V]: ``tokens[r]``'s log-probability and rank
    (1 = most likely), and the ``num_top[r]`` most likely tokens' (-1: every token), as a
    dict token id -> ``Logprob``, the given token first. A rank is read off the top tokens
    where the token is among them; only the other rows count the tokens above theirs.
    ``values``: report the logits themselves in place of log-probabilities (the "*_logits"
    logprobs modes); the ranks and the top tokens are the same either way."""
    logprobs = logits.float() if values else torch.log_softmax(logits.float(), dim=-1)
    vocab = logits.shape[1]
    widths = [vocab if k < 0 else min(k, vocab) for k in num_top]
    width = max(max(widths, default=0), 1)  # the top token at least: a greedy pick's rank is 1
    top_values, top_ids = logprobs.topk(width, dim=-1)
    chosen_column = logprobs.gather(1, tokens[:, None])
    chosen = chosen_column[:, 0].tolist()
    top_values, top_ids, token_list = top_values.tolist(), top_ids.tolist(), tokens.tolist()
    ranks: list[int | None] = [ids.index(t) + 1 if t in ids else None for t, ids in zip(token_list, top_ids,
                                                                                        strict=True)]
    outside = [r for r, rank in enumerate(ranks) if rank is None]
    if outside:
        if len(outside) == len(ranks):  # no row copies
            counted = (logprobs > chosen_column).sum(dim=-1) + 1
        else:
            rows = torch.tensor(outside, device=logits.device)
            counted = (logprobs[rows] > chosen_column[rows]).sum(dim=-1) + 1
        for r, rank in zip(outside, counted.tolist(), strict=True):
            ranks[r] = rank
    out = []
    for r, token in enumerate(token_list):
        entry = {token: Logprob(chosen[r], ranks[r])}
        ids, values = top_ids[r], top_values[r]
        for j in range(widths[r]):
            if ids[j] not in entry:
                entry[ids[j]] = Logprob(values[j], j + 1)
        out.append(entry)
    return out
