"""The sampler's inverse-CDF draw: frequencies follow the distribution, tokens of
probability zero (top-k, top-p cut) never come, seeded rows repeat whatever their batch."""

from __future__ import annotations

import torch

from hyprefix.outputs import ScheduledSeq
from hyprefix.runner.sampler import Sampler
from hyprefix.sampling import SamplingParams


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
    """A grammar allowing a fixed set of tokens (the sampler's view of ``structured.grammar.Grammar``)."""

    masks_first = False

    def __init__(self, allowed: set[int]) -> None:
        self.allowed = allowed

    def allows(self, token: int) -> bool:
        return token in self.allowed

    def accept(self, token: int) -> bool:
        assert token in self.allowed
        return True


def _masks(grammars: list[_Grammar], vocab_size: int) -> torch.Tensor:
    masks = torch.zeros(len(grammars), vocab_size, dtype=torch.bool)
    for row, grammar in enumerate(grammars):
        masks[row, sorted(grammar.allowed)] = True
    return masks


def test_grammar_rows_sample_the_masked_distribution():
    """Allowed tokens 2, 3 and 5 hold 0.25 + 0.125 + 0.125 of the mass (then 0.03): keeping an
    allowed pick and redrawing a refused one among the allowed must give 1/2, 1/4, 1/4 (1/3 each)."""
    for probs, allowed in ((torch.tensor([0.5, 0.0, 0.25, 0.125, 0.0, 0.125]), {2, 3, 5}),
                           (torch.tensor([0.97, 0.0, 0.01, 0.01, 0.0, 0.01]), {2, 3, 5})):
        logits = probs.log().expand(3000, -1).contiguous()
        seqs = [ScheduledSeq(f"r{i}", [1], 0, [0], True, SamplingParams(temperature=1.0), grammar=_Grammar(allowed))
                for i in range(3000)]
        tokens, _ = Sampler(seed=1, device=torch.device("cpu"), masks_of=_masks).sample(logits, seqs)
        counts = torch.bincount(torch.tensor(tokens), minlength=6).float() / 3000
        expected = torch.zeros(6)
        expected[sorted(allowed)] = probs[sorted(allowed)] / probs[sorted(allowed)].sum()
        assert torch.allclose(counts, expected, atol=0.035), counts
    greedy = [ScheduledSeq("g", [1], 0, [0], True, SamplingParams(temperature=0), grammar=_Grammar({3, 5}))]
    sampler = Sampler(seed=1, device=torch.device("cpu"), masks_of=_masks)
    picked, _ = sampler.sample(torch.tensor([[5.0, 1, 2, 3, 0, 4]]), greedy)
    assert picked == [5]  # the most likely allowed token
