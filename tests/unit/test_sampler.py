"""The sampler's inverse-CDF draw: frequencies follow the distribution, tokens of
probability zero (top-k, top-p cut) never come, seeded rows repeat whatever their batch."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from hyprefix.outputs import ScheduledSeq, SchedulerOutput
from hyprefix.runner.sampler import Sampler
from hyprefix.sampling import SamplingParams
from hyprefix.structured.step_masks import GrammarMasks, StepMasks


def _seqs(n: int, **params) -> list[ScheduledSeq]:
    return [ScheduledSeq(f"r{i}", [1], 0, [0], True, SamplingParams(**params)) for i in range(n)]


def test_frequencies_follow_the_distribution_and_zero_mass_never_comes():
    probs = torch.tensor([0.5, 0.0, 0.25, 0.125, 0.0, 0.125])
    logits = probs.log().expand(4000, -1).contiguous()
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    tokens, _ = sampler.sample(logits, _seqs(4000, temperature=1.0))
    counts = torch.bincount(torch.tensor(tokens), minlength=6).float() / 4000
    assert counts[1] == 0 and counts[4] == 0
    assert torch.allclose(counts, probs, atol=0.03), counts
    cut, _ = sampler.sample(logits, _seqs(4000, temperature=1.0, top_k=2))  # only tokens 0 and 2
    assert set(cut) == {0, 2}
    top_p, _ = sampler.sample(logits, _seqs(4000, temperature=1.0, top_p=0.4))  # token 0 alone
    assert set(top_p) == {0}


def test_seeded_rows_repeat_whatever_else_is_in_the_batch():
    logits = torch.randn(3, 1000)
    seeded = SamplingParams(temperature=1.0, seed=42)
    first, _ = Sampler(0, torch.device("cpu")).sample(logits[:1], [ScheduledSeq("a", [1], 0, [0], True, seeded)])
    batch = [ScheduledSeq("x", [1], 0, [0], True, SamplingParams(temperature=0.7)),
             ScheduledSeq("a", [1], 0, [0], True, seeded),
             ScheduledSeq("y", [1], 0, [0], True, SamplingParams(temperature=1.0, seed=7))]
    mixed, _ = Sampler(5, torch.device("cpu")).sample(torch.stack([logits[1], logits[0], logits[2]]), batch)
    assert mixed[1] == first[0]


class _Grammar:
    """A grammar allowing a fixed set of tokens (what a step's ``GrammarMasks`` reads of
    ``structured.grammar.Grammar``); the sampler must never advance it."""

    def __init__(self, allowed: set[int], masks_first: bool = False) -> None:
        self.allowed = allowed
        self.masks_first = masks_first

    def allows(self, token: int) -> bool:
        return token in self.allowed

    def accept(self, token: int) -> bool:
        raise AssertionError("only Scheduler.update advances a grammar")


def _masks(grammars: list[_Grammar], vocab_size: int) -> torch.Tensor:
    masks = torch.zeros(len(grammars), vocab_size, dtype=torch.bool)
    for row, grammar in enumerate(grammars):
        masks[row, sorted(grammar.allowed)] = True
    return masks


def _bitmask(grammars: list[_Grammar], vocab_size: int) -> torch.Tensor:
    """``structured.grammar.fill_masks`` for stand-in grammars: int32 [len, ceil(V / 32)]."""
    bits = torch.zeros(len(grammars), -(-vocab_size // 32), dtype=torch.int64)
    for row, grammar in enumerate(grammars):
        for token in grammar.allowed:
            bits[row, token // 32] |= 1 << (token % 32)
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)


def _step_masks(seqs: list[ScheduledSeq], grammars: dict[str, _Grammar], vocab_size: int) -> GrammarMasks | None:
    """The step's masks as the engine starts them (``StepMasks.start``) for stand-in grammars."""
    requests = {rid: SimpleNamespace(grammar=g) for rid, g in grammars.items()}
    return StepMasks(vocab_size, fill=_bitmask, masks_of=_masks).start(SchedulerOutput(seqs, len(seqs)), requests)


def test_grammar_rows_sample_the_masked_distribution():
    """Allowed tokens 2, 3 and 5 hold 0.25 + 0.125 + 0.125 of the mass (then 0.03): keeping an
    allowed pick and redrawing a refused one among the allowed must give 1/2, 1/4, 1/4 (1/3 each)."""
    for probs, allowed in ((torch.tensor([0.5, 0.0, 0.25, 0.125, 0.0, 0.125]), {2, 3, 5}),
                           (torch.tensor([0.97, 0.0, 0.01, 0.01, 0.0, 0.01]), {2, 3, 5})):
        logits = probs.log().expand(3000, -1).contiguous()
        seqs = _seqs(3000, temperature=1.0)
        masks = GrammarMasks({s.request_id: _Grammar(allowed) for s in seqs}, masks_of=_masks)
        tokens, _ = Sampler(seed=1, device=torch.device("cpu")).sample(logits, seqs, masks=masks)
        counts = torch.bincount(torch.tensor(tokens), minlength=6).float() / 3000
        expected = torch.zeros(6)
        expected[sorted(allowed)] = probs[sorted(allowed)] / probs[sorted(allowed)].sum()
        assert torch.allclose(counts, expected, atol=0.035), counts
    greedy = [ScheduledSeq("g", [1], 0, [0], True, SamplingParams(temperature=0))]
    sampler = Sampler(seed=1, device=torch.device("cpu"))
    picked, _ = sampler.sample(torch.tensor([[5.0, 1, 2, 3, 0, 4]]), greedy,
                               masks=GrammarMasks({"g": _Grammar({3, 5})}, masks_of=_masks))
    assert picked == [5]  # the most likely allowed token


def test_masked_first_and_checked_rows_follow_their_grammars_without_advancing_them():
    """A step mixing a row without a grammar, a checked grammar row and masks-first rows (in
    another order than the step's): each row's token is what its grammar allows; the
    masks-first rows' processed logprobs are -inf outside their mask; nothing calls
    ``accept`` (``_Grammar.accept`` raises)."""
    logits = torch.tensor([[9.0, 1, 2, 3, 0, 4, 8, 7]] * 4)
    seqs = [ScheduledSeq("free", [1], 0, [0], True, SamplingParams(temperature=0)),
            ScheduledSeq("first", [1], 0, [0], True, SamplingParams(temperature=1.0, top_k=3, logprobs=2)),
            ScheduledSeq("checked", [1], 0, [0], True, SamplingParams(temperature=0)),
            ScheduledSeq("greedy-first", [1], 0, [0], True, SamplingParams(temperature=0, logprobs=1))]
    grammars = {"greedy-first": _Grammar({1, 4}, masks_first=True), "checked": _Grammar({2, 3}),
                "first": _Grammar({3, 5, 7}, masks_first=True)}
    masks = _step_masks(list(reversed(seqs)), grammars, 8)
    assert "free" not in masks and len(masks) == 3
    assert masks.masks_first("first") and not masks.masks_first("checked")
    sampler = Sampler(seed=3, device=torch.device("cpu"), logprobs_mode="processed_logprobs")
    for _ in range(20):
        tokens, logprobs = sampler.sample(logits, seqs, masks=masks)
        assert tokens[0] == 0 and tokens[1] in {3, 5, 7} and tokens[2] == 3 and tokens[3] == 1
        assert set(logprobs) == {1, 3}
        assert set(logprobs[1]) <= {3, 5, 7} and set(logprobs[3]) == {1}
        assert abs(logprobs[3][1].logprob - math.log(math.e / (math.e + 1))) < 1e-5
    assert _step_masks(seqs, {}, 8) is None  # no grammar row: nothing to start
