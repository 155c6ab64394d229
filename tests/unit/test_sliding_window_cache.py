"""Sliding-window layers with a block pool of their own (``cache/sliding.py``), on plain
data: blocks leave a running request as they leave its window, the prefix stays
findable, hits need the window before them to be cached, nothing leaks."""

from __future__ import annotations

import random

from hyprefix.cache.coordinator import hit_num_blocks
from tests.support.plain_scheduling import (
    expected_output,
    make_scheduler,
    req,
    run_to_end,
    seq_of,
    step,
    toks,
    window_kind,
)

BS, WINDOW = 4, 8


def scheduler(window_blocks: int = 32, num_blocks: int = 64, budget: int = 8, max_seqs: int = 4):
    return make_scheduler(num_blocks, BS, budget, max_seqs, window=WINDOW, window_blocks=window_blocks)


def first_needed(position: int) -> int:
    return max(0, position - WINDOW + 1) // BS


def test_blocks_leave_a_running_request_with_its_window():
    s = scheduler()
    kind = window_kind(s)
    a = req("a", toks(100, 40), max_tokens=6)
    s.add_request(a)
    peak = 0

    def on_plan(out):
        nonlocal peak
        q = seq_of(out, "a")
        first = first_needed(q.start_pos)
        assert q.window_first_block == first
        assert len(q.window_blocks) >= -(-q.context_len // BS) - first
        # The full-attention layers keep every block; the window pool only the window's.
        assert len(q.block_table) >= -(-q.context_len // BS)
        peak = max(peak, kind.pool.num_used)

    run_to_end(s, on_plan=on_plan)
    # A step computes at most 8 tokens and sees 7 before them: 15 positions span <= 5 blocks.
    assert peak <= 5
    assert kind.blocks_released >= 8
    assert kind.pool.num_used == 0 and s.cache.kv.pool.num_used == 0
    assert a.output_token_ids == expected_output(a)


def test_hit_longer_than_the_window_reuses_the_cached_window():
    s = scheduler()
    kind = window_kind(s)
    a = req("a", toks(100, 40), max_tokens=6)
    s.add_request(a)
    run_to_end(s)
    a_hashes = list(a.block_hashes)

    b = req("b", toks(100, 32) + toks(900, 5), max_tokens=3)
    s.add_request(b)
    out = step(s)
    q = seq_of(out, "b")
    assert b.num_cached_tokens == 32 > WINDOW
    assert q.start_pos == 32 and q.window_first_block == first_needed(32) == 6
    # Blocks 6 and 7 (positions 24..31) come from a's window, found by hash.
    assert q.window_blocks[:2] == [kind.pool.lookup(h) for h in a_hashes[6:8]]
    run_to_end(s)
    assert b.output_token_ids == expected_output(b)

    # A block-aligned repeat of a's prompt is a full hit: it reads its last token's
    # K/V in place, so the window pool must hold that block too.
    c = req("c", toks(100, 40), max_tokens=2)
    s.add_request(c)
    q = seq_of(step(s), "c")
    assert (q.start_pos, q.num_tokens, q.write_kv) == (39, 1, False)
    assert q.window_first_block == first_needed(39) == 8
    assert q.window_blocks[:2] == [kind.pool.lookup(h) for h in a_hashes[8:10]]
    run_to_end(s)
    assert c.output_token_ids == expected_output(c)


def test_hit_shortens_when_the_window_before_it_was_evicted():
    s = scheduler()
    a = req("a", toks(100, 40), max_tokens=2)
    s.add_request(a)
    run_to_end(s)
    window_kind(s).reset()  # the window pool forgot everything; the full-attention pool did not
    b = req("b", toks(100, 32) + toks(900, 5), max_tokens=2)
    s.add_request(b)
    step(s)
    assert b.num_cached_tokens == 0
    assert s.cache.hit_tokens_lost == 32
    run_to_end(s)
    assert b.output_token_ids == expected_output(b)


def test_no_window_pool_without_caching_still_releases_blocks():
    s = make_scheduler(64, BS, 8, 4, caching=False, window=WINDOW, window_blocks=32)
    a = req("a", toks(100, 40), max_tokens=4)
    s.add_request(a)
    run_to_end(s)
    kind = window_kind(s)
    assert kind.blocks_released >= 8 and kind.pool.num_cached == 0 and kind.pool.num_used == 0
    assert a.output_token_ids == expected_output(a)


def oracle_hit(s, request, dense: int, cached_blocks: int) -> int:
    """The longest L <= ``dense`` (a block boundary, or the last token of a full hit)
    whose window blocks are all in the window pool's index: by brute force."""
    kind = window_kind(s)

    def window_cached(tokens: int) -> bool:
        blocks = range(first_needed(tokens), hit_num_blocks(request, tokens, cached_blocks, BS))
        return all(kind.pool.lookup(request.block_hashes[i]) is not None for i in blocks)

    candidates = [*range(0, dense + 1, BS), dense]
    ok = [n for n in candidates if n == 0 or (window_cached(n) and (n % BS == 0 or n == request.num_tokens - 1))]
    return max(ok)


def test_random_traffic_in_a_small_window_pool_matches_the_oracle():
    """Shared prefixes longer than the window, a window pool too small for everyone
    (preemptions, evictions): every hit is the longest whose window is cached, every
    request gets its expected tokens, the invariants hold after every step."""
    rng = random.Random(0)
    s = scheduler(window_blocks=10, num_blocks=48, budget=12, max_seqs=4)
    coord = s.cache
    find_hit = coord.find_hit
    checked = 0

    def checked_find_hit(request):
        nonlocal checked
        hit = find_hit(request)
        if hit.wait_for is None:
            assert hit.num_tokens == oracle_hit(s, request, hit.dense_tokens, hit.kv_blocks)
            checked += 1
        return hit

    coord.find_hit = checked_find_hit
    prefixes = [toks(1000 * (i + 1), n) for i, n in enumerate((12, 20, 29, 36))]
    requests = []
    for i in range(40):
        prefix = rng.choice(prefixes)
        cut = rng.randint(len(prefix) // 2, len(prefix))
        prompt = prefix[:cut] + (toks(50_000 + 100 * i, rng.randint(1, 9)) if rng.random() < 0.6 else [])
        r = req(f"r{i}", prompt, max_tokens=rng.randint(1, 14))
        requests.append(r)
        s.add_request(r)
        if rng.random() < 0.5:
            step(s)
    run_to_end(s, max_steps=3000)
    assert checked >= 40
    for r in requests:
        assert r.output_token_ids == expected_output(r), r.request_id
    kind = window_kind(s)
    assert kind.pool.num_used == 0 and coord.kv.pool.num_used == 0
    assert s.num_preemptions > 0, "the window pool was meant to be too small"
    assert coord.hit_tokens_lost > 0, "some hit was meant to lose its evicted window"
    assert sum(r.num_cached_tokens > WINDOW for r in requests) >= 5
