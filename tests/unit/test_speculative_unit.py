"""Speculative decoding's plain-data parts: the config, the prompt-lookup index, the adaptive
back-off, the verification rule, and the scheduler's rollback and publication (no torch)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyprefix.config import EngineArgs
from hyprefix.outputs import ScheduledSeq
from hyprefix.runner.verify import accept, sample_rows
from hyprefix.sampling import SamplingParams
from hyprefix.scheduler import Scheduler, SchedulerConfig
from hyprefix.speculative import MAX_SKIPPED_CHANCES, DraftState, NgramIndex, SpeculativeConfig
from tests.support.plain_scheduling import kv, make_scheduler, req, toks


def test_config_defaults_follow_vllm():
    both = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3})
    assert (both.prompt_lookup_min, both.prompt_lookup_max) == (5, 5)
    low = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}')
    assert (low.prompt_lookup_min, low.prompt_lookup_max) == (2, 2)
    high = SpeculativeConfig.parse({"num_speculative_tokens": 4, "prompt_lookup_max": 4})
    assert (high.prompt_lookup_min, high.prompt_lookup_max, high.k) == (4, 4, 4)
    assert SpeculativeConfig.parse(None) is None


@pytest.mark.parametrize("value, message", [
    ({"method": "eagle", "num_speculative_tokens": 3}, "not supported"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "<="),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, "unknown"),
    ("not json", "JSON"),
    ("[1, 2]", "JSON object"),
])
def test_config_refuses_what_it_cannot_honour(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)
    with pytest.raises(ValueError, match=message):
        EngineArgs(speculative_config=value)


def test_index_proposes_what_followed_the_latest_longest_match():
    index = NgramIndex(1, 3)
    tokens = [7, 1, 2, 3, 9, 1, 2, 3, 4, 5, 0, 2, 3]
    # (2, 3) ends earlier at 4 (then 9) and at 8 (then 4): the latest wins, and the 3-gram (0, 2, 3) is unseen
    assert index.propose(tokens, 3) == [4, 5, 0]
    assert index.propose([*tokens, 4, 5], 2) == [0, 2]  # (3, 4, 5) -> 0
    # (5, 0, 2) ends at 12: what follows to the end of the list, then around that loop again
    assert index.propose([*tokens, 4, 5, 0, 2], 7) == [3, 4, 5, 0, 2, 3, 4]
    assert NgramIndex(1, 2).propose([8, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]  # a period of 2
    assert NgramIndex(1, 3).propose([1, 2, 3, 4], 3) == []  # no repeats
    assert NgramIndex(2, 2).propose([5, 6, 5], 4) == []  # too short a match for the lower bound


def _reference_propose(tokens: list[int], low: int, high: int, k: int) -> list[int]:
    size = len(tokens)
    for n in range(min(high, size - 1), low - 1, -1):
        suffix = tokens[size - n:]
        for end in range(size - 1, n - 1, -1):  # latest earlier occurrence with a follower
            if tokens[end - n:end] == suffix:
                return [tokens[end + i % (size - end)] for i in range(k)]
    return []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=60), st.integers(1, 3), st.integers(0, 2),
       st.integers(1, 6), st.integers(1, 20))
def test_index_matches_a_brute_force_search_as_tokens_grow(tokens, low, extra, k, step):
    index = NgramIndex(low, low + extra)
    for end in range(1, len(tokens) + 1, step):  # grown in steps, as decoding appends
        assert index.propose(tokens[:end], k) == _reference_propose(tokens[:end], low, low + extra, k)


def test_drafting_backs_off_after_misses_and_resets_on_acceptance():
    state = DraftState(NgramIndex(1, 1))
    tokens = [1, 2, 1]
    assert state.propose(tokens, 2) == [2, 1]
    state.verified(2, 0)
    assert state.propose(tokens, 2) == []  # one chance skipped
    assert state.propose(tokens, 2) == [2]  # and the next draft is as long as what stood plus one
    state.verified(1, 0)
    assert [state.propose(tokens, 2) for _ in range(4)] == [[], [], [], [2]]  # three skipped
    for _ in range(10):
        state.verified(1, 0)
    assert state.skip == MAX_SKIPPED_CHANCES
    state.skip = 0
    state.verified(1, 1)  # all of it stood: one longer
    assert state.misses == 0 and state.propose(tokens, 4) == [2, 1]
    state.verified(2, 1)
    assert state.propose(tokens, 4) == [2, 1]  # what stood plus one
    assert (state.counts.num_drafts, state.counts.num_draft_tokens, state.counts.num_accepted_tokens) == (14, 16, 2)


def test_accept_keeps_the_drafts_the_samples_confirm():
    assert accept([5, 6, 7, 8], [5, 6, 7]) == 3  # all, and 8 is the bonus token
    assert accept([5, 9, 7, 8], [5, 6, 7]) == 1  # the second draft refused: 9 replaces it
    assert accept([4, 6, 7, 8], [5, 6, 7]) == 0


def test_sample_rows_see_the_drafts_before_them():
    seq = ScheduledSeq("r", [10, 11, 12], 20, [0, 1], True, SamplingParams(), num_generated=3,
                       output_token_ids=[7, 8, 10], num_drafts=2)
    rows = sample_rows(seq)
    assert [(r.token_ids, r.start_pos, r.num_generated, list(r.output_token_ids)) for r in rows] == [
        ([10], 20, 3, [7, 8, 10]), ([11], 21, 4, [7, 8, 10, 11]), ([12], 22, 5, [7, 8, 10, 11, 12])]
    assert all(r.sample and not r.num_drafts for r in rows)


def _spec_scheduler(num_blocks: int = 32, k: int = 4, **config) -> Scheduler:
    base = make_scheduler(num_blocks, 4, 64, 4)
    spec = SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=1, prompt_lookup_max=2)
    return Scheduler(SchedulerConfig(64, 4, speculative=spec, **config), base.cache)


def test_rejected_drafts_roll_back_before_publication():
    """A prompt that repeats itself drafts; the step's accepted tokens advance the request, and
    only blocks whose every token stands are published, under the hashes of the tokens that stand."""
    s = _spec_scheduler()
    r = req("a", [1, 2, 3, 1, 2, 3, 1], max_tokens=20)
    s.add_request(r)
    out = s.schedule()
    s.update(out, {"a": [2]})  # prefill, then the first token: context ends 3 1 2 -> drafts 3 1 2 3
    out = s.schedule()
    (seq,) = out.seqs
    assert seq.num_drafts == 4 and seq.token_ids == [2, 3, 1, 2, 3] and seq.start_pos == 7
    assert len(kv(s).block_table("a")) * 4 >= 12  # room for every draft
    s.update(out, {"a": [3, 9]})  # draft 3 stands, 1 refused: 9 instead
    assert r.output_token_ids == [2, 3, 9] and r.num_computed_tokens == 9 and r.num_new_tokens == 2
    # blocks 0 and 1 (tokens 0..7) are complete and stand; block 2 holds refused drafts: not findable
    assert [kv(s).pool.lookup(h) is not None for h in r.block_hashes] == [True, True]
    assert s.spec_stats.num_drafts == 1 and s.spec_stats.num_accepted_tokens == 1
    assert s.spec_stats.accepted_per_pos == [1, 0, 0, 0]
    s.check_invariants()


def test_drafts_respect_max_tokens_budget_and_block_boundaries():
    s = _spec_scheduler()
    r = req("a", [1, 2, 1, 2, 1, 2, 1], max_tokens=3)
    s.add_request(r)
    s.update(s.schedule(), {"a": [2]})
    (seq,) = s.schedule().seqs
    assert seq.num_drafts == 1  # max_tokens 3: one output, one draft, one token sampled after it

    hybrid = Scheduler(SchedulerConfig(64, 4, speculative=SpeculativeConfig(num_speculative_tokens=8,
                                                                            prompt_lookup_min=1),
                                       drafts_within_block=True),
                       make_scheduler(64, 4, 64, 4, checkpoints=8).cache)
    r = req("h", [1, 2, 1, 2, 1, 2, 1, 2, 1], max_tokens=30)  # 9 tokens: the next boundary is 12
    hybrid.add_request(r)
    hybrid.update(hybrid.schedule(), {"h": [2]})
    (seq,) = hybrid.schedule().seqs
    assert seq.start_pos == 9 and seq.num_drafts == 1  # computes 9 and 10: never reaches 12


def test_a_stop_inside_accepted_drafts_ends_the_output_there():
    s = _spec_scheduler()
    r = req("a", [1, 2, 3, 1, 2, 3, 1], max_tokens=20, stop_token_ids=[3])
    s.add_request(r)
    s.update(s.schedule(), {"a": [2]})
    out = s.schedule()
    assert out.seqs[0].num_drafts == 4
    advanced = s.update(out, {"a": [3, 1, 2, 3, 5]})
    assert advanced == [r] and r.output_token_ids == [2, 3] and r.finish_reason == "stop"
    assert r.is_finished and not kv(s).holds("a")
    s.check_invariants()


def test_max_draft_rows_limits_the_rows_that_draft():
    s = _spec_scheduler(max_draft_rows=1)
    for rid in ("a", "b"):
        s.add_request(req(rid, toks(1, 3) * 3, max_tokens=20))
    s.update(s.schedule(), {"a": [1], "b": [1]})
    out = s.schedule()
    assert [seq.num_drafts for seq in out.seqs] == [4, 0]


def test_a_drafting_requests_context_grows_with_its_output():
    state = DraftState(NgramIndex(1, 2))
    prompt, output = [1, 2, 3], [4]
    assert state.context(prompt, output) == [1, 2, 3, 4]
    output += [5, 6]
    tokens = state.context(prompt, output)
    assert tokens == [1, 2, 3, 4, 5, 6] and tokens is state.tokens
