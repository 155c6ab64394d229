"""KV cache events: what the cache announces (plain data, exact hashes), that an index
rebuilt from the events always equals the cache's own index (dense and hybrid, random
workloads), and the wire format (vLLM's msgpack arrays)."""

from __future__ import annotations

import random

import msgpack
import pytest

from hyprefix.cache import hashing
from hyprefix.cache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventLog,
    StateRemoved,
    StateStored,
)
from hyprefix.cache.recurrent import RecurrentStateCache
from hyprefix.cache.state_pool import block_of
from hyprefix.config import EngineArgs
from hyprefix.kv_events import KVEventsConfig, decode_batch, encode_batch, replay, split_streams
from hyprefix.routing.index import PrefixIndex
from tests.support.plain_scheduling import make_scheduler, req, run_to_end, state_kind, step, toks

BS = 4


def hashes_of(tokens: list[int], salt: str | None = None) -> list[bytes]:
    out: list[bytes] = []
    hashing.extend_hashes(out, hashing.root_hash("test-model", salt), tokens, BS)
    return out


def test_a_request_announces_its_blocks_as_they_fill_and_evictions_and_reset_remove_them():
    log = EventLog(enabled=True)
    s = make_scheduler(num_blocks=4, block_size=BS, budget=64, max_seqs=4, events=log)
    a = req("a", toks(100, 10), max_tokens=3)
    s.add_request(a)
    step(s)  # prefill: blocks 0 and 1 are full and computed
    h = hashes_of(toks(100, 10) + a.output_token_ids[:2])
    assert log.drain() == [BlockStored([h[0], h[1]], None, toks(100, 8), BS)]
    run_to_end(s)  # 12 of the 13 tokens computed: block 2 fills with two generated tokens
    tokens = a.all_token_ids
    assert hashes_of(tokens)[:2] == h[:2]
    assert log.drain() == [BlockStored([hashes_of(tokens)[2]], h[1], tokens[8:12], BS)]

    b = req("b", toks(500, 15), max_tokens=1)  # needs all 4 blocks: evicts a's, tail first
    s.add_request(b)
    step(s)
    events = log.drain()
    assert events[0] == BlockRemoved(list(reversed(hashes_of(tokens)[:3])))
    assert events[1:] == [BlockStored(hashes_of(toks(500, 12)), None, toks(500, 12), BS)]
    run_to_end(s)
    log.drain()
    assert s.cache.reset_cache() == 3
    assert log.drain() == [BlockRemoved(list(reversed(hashes_of(toks(500, 12))))), AllBlocksCleared()]


def test_a_disabled_log_keeps_nothing():
    log = EventLog()
    s = make_scheduler(num_blocks=8, block_size=BS, budget=64, max_seqs=4, events=log)
    s.add_request(req("a", toks(0, 9)))
    run_to_end(s)
    assert log.drain() == []


def test_a_block_another_request_already_published_is_not_announced_twice():
    log = EventLog(enabled=True)
    s = make_scheduler(num_blocks=16, block_size=BS, budget=64, max_seqs=4, events=log)
    s.add_request(req("a", toks(0, 9), max_tokens=1))
    s.add_request(req("b", toks(0, 9), max_tokens=1))  # the same prompt in the same step
    run_to_end(s)
    stored = [h for e in log.drain() if isinstance(e, BlockStored) for h in e.block_hashes]
    assert sorted(stored) == sorted(set(stored)) and set(hashes_of(toks(0, 8))) <= set(stored)


def truth(s) -> tuple[set[bytes], set[bytes], set[bytes]]:
    """(KV hashes the pool indexes, checkpoints at block ends, checkpoints one token before)."""
    states: set[bytes] = set()
    before: set[bytes] = set()
    if any(isinstance(k, RecurrentStateCache) for k in s.cache.kinds):
        for key in state_kind(s).pool._index:
            (states if block_of(key) == key else before).add(block_of(key))
    return set(s.cache.kv.pool._hash_index), states, before


@pytest.mark.parametrize("hybrid", [False, True], ids=["dense", "hybrid"])
def test_an_index_rebuilt_from_the_events_equals_the_cache_after_every_step(hybrid):
    """Random shared-prefix traffic through a small pool (evictions, preemption, resets):
    after each step the subscriber's view is exactly what the cache holds."""
    rng = random.Random(7)
    log = EventLog(enabled=True)
    s = make_scheduler(num_blocks=24, block_size=BS, budget=32, max_seqs=4, events=log,
                       checkpoints=6 if hybrid else None)
    index = PrefixIndex()
    stems = [toks(1000 * i, rng.randrange(4, 20)) for i in range(4)]
    n = 0
    seen: dict[str, int] = {}
    for round_ in range(60):
        for _ in range(rng.randrange(0, 3)):
            prompt = rng.choice(stems) + toks(50_000 + 100 * n, rng.randrange(1, 9))
            s.add_request(req(f"r{n}", prompt, max_tokens=rng.randrange(1, 6), salt=rng.choice([None, "t"])))
            n += 1
        if s.has_unfinished():
            step(s)
        if round_ % 17 == 16:
            s.cache.reset_cache()
        events = log.drain()
        for e in events:
            seen[type(e).__name__] = seen.get(type(e).__name__, 0) + 1
        index.apply(events)
        kv_hashes, states, before = truth(s)
        assert index.blocks == kv_hashes
        assert (index.states, index.states_before_last) == (states, before)
    assert index.hybrid == hybrid and kv_hashes
    assert seen["BlockStored"] and seen["BlockRemoved"]
    assert not hybrid or (seen["StateStored"] and seen["StateRemoved"])
    run_to_end(s)
    s.cache.reset_cache()  # nothing runs: everything goes
    events = log.drain()
    assert isinstance(events[-1], AllBlocksCleared)
    index.apply(events)
    assert (index.blocks, index.states, index.states_before_last) == (set(), set(), set())
    assert truth(s) == (set(), set(), set())


def test_the_index_finds_the_usable_prefix_of_dense_and_hybrid_replicas():
    h = [bytes([i]) * 32 for i in range(4)]
    dense = PrefixIndex()
    dense.apply([BlockStored(h[:3], None, toks(0, 12), BS)])
    assert dense.usable_blocks(h) == 3
    hybrid = PrefixIndex()
    hybrid.apply([BlockStored(h, None, toks(0, 16), BS), StateStored([h[1]]), StateStored([h[3]], True)])
    assert hybrid.cached_blocks(h) == 4
    assert hybrid.usable_blocks(h) == 2  # the checkpoint at the end of block 1
    assert hybrid.usable_blocks(h, prompt_is_block_aligned=True) == 3.5
    hybrid.apply([StateRemoved([h[1]]), BlockRemoved([h[0]])])
    assert hybrid.usable_blocks(h) == 0


def test_wire_format_is_vllms_msgpack_arrays_and_round_trips():
    h = [bytes([i]) * 32 for i in range(3)]
    events = [BlockStored(h[:2], None, [1, 2, 3, 4, 5, 6, 7, 8], BS), BlockRemoved([h[2]]), AllBlocksCleared()]
    payload = encode_batch(events, ts=12.5)
    assert msgpack.unpackb(payload) == [12.5, [
        ["BlockStored", h[:2], None, [1, 2, 3, 4, 5, 6, 7, 8], BS, None, None],
        ["BlockRemoved", [h[2]], None],
        ["AllBlocksCleared"]]]
    assert decode_batch(payload) == (12.5, events)
    state = [StateStored([h[0]]), StateRemoved([h[1]], before_last_token=True)]
    assert msgpack.unpackb(encode_batch(state, ts=1.0)) == [1.0, [["StateStored", [h[0]], False],
                                                                  ["StateRemoved", [h[1]], True]]]
    assert split_streams(events + state) == (events, state)
    # vLLM's newer fields trail the ones we read: a decoder that reads the first ones keeps working
    longer = msgpack.packb([3.0, [["BlockStored", [h[0]], h[1], [9] * 4, BS, None, "GPU", None, None]]])
    assert decode_batch(longer) == (3.0, [BlockStored([h[0]], h[1], [9] * 4, BS)])


@pytest.mark.parametrize("text, message", [
    ("{", "not valid JSON"),
    ('{"endpoint": "tcp://*:5557", "bogus": 1}', "unknown field"),
    ('{"topic": "kv", "state_topic": "kv-state"}', "prefix"),
    ('{"publisher": "kafka"}', "publisher"),
])
def test_bad_event_configs_are_user_errors(text, message):
    with pytest.raises(ValueError, match=message):
        KVEventsConfig.read(text)
    with pytest.raises(ValueError, match=message):
        EngineArgs(kv_events_config=text)  # refused where the flag is read


def test_a_disabled_config_turns_events_off():
    from hyprefix.engine_config import EngineConfig

    assert not KVEventsConfig.read('{"enable_kv_cache_events": false}').enabled
    assert EngineConfig.from_args(EngineArgs(kv_events_config={"enable_kv_cache_events": False})).events is None
    assert EngineConfig.from_args(EngineArgs()).events is None
    assert KVEventsConfig.read('{"endpoint": "tcp://127.0.0.1:0"}').endpoint == "tcp://127.0.0.1:0"
    parsed = EngineArgs(kv_events_config='{"endpoint": "tcp://127.0.0.1:0"}').kv_events_config
    assert isinstance(parsed, KVEventsConfig) and parsed.endpoint == "tcp://127.0.0.1:0"  # no JSON text past here


# ------------------------------------------------------------------ over ZMQ, from an engine
def _engine_with_events(path, **kwargs):
    from hyprefix import LLM

    config = '{"endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"}'
    return LLM(str(path), dtype="float32", num_kv_blocks=64, kv_events_config=config, enforce_eager=True, **kwargs)


def _subscribe(endpoint: str, topic: str):
    import zmq

    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt_string(zmq.SUBSCRIBE, topic)
    sub.connect(endpoint)
    return sub


def _receive(sub, until, timeout_s: float = 10.0) -> list[tuple[int, bytes]]:
    """(seq, payload) messages until ``until(events so far)`` or the timeout."""
    import time

    got, events = [], []
    deadline = time.monotonic() + timeout_s
    while not until(events) and time.monotonic() < deadline:
        if sub.poll(100):
            _, seq, payload = sub.recv_multipart()
            got.append((int.from_bytes(seq, "big"), payload))
            events.extend(decode_batch(payload)[1])
    return got


def test_an_engine_publishes_its_blocks_over_zmq_with_replay(tiny_models):
    from hyprefix import SamplingParams

    llm = _engine_with_events(tiny_models["llama"][0])
    publisher = llm.engine.event_publisher
    sub = _subscribe(publisher.endpoint, "kv-events")
    state_sub = _subscribe(publisher.endpoint, "hybrid-state")
    import time

    time.sleep(0.3)  # let the subscriptions reach the publisher (ZMQ drops what comes before)
    prompt = list(range(3, 40))  # 37 tokens: two full blocks of 16
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                       use_tqdm=False)[0]
    expected: list[bytes] = []
    root = hashing.root_hash(llm.engine.model_identity, None)
    hashing.extend_hashes(expected, root, prompt + out.outputs[0].token_ids, 16)
    got = _receive(sub, lambda ev: sum(len(e.block_hashes) for e in ev if isinstance(e, BlockStored)) >= 2)
    assert [seq for seq, _ in got] == list(range(len(got)))
    stored = [e for _, p in got for e in decode_batch(p)[1]]
    assert stored == [BlockStored(expected[:2], None, prompt[:32], 16)]
    assert llm.reset_prefix_cache() == 2
    cleared = _receive(sub, lambda ev: any(isinstance(e, AllBlocksCleared) for e in ev))
    assert [e for _, p in cleared for e in decode_batch(p)[1]] == [BlockRemoved(expected[1::-1]), AllBlocksCleared()]
    assert replay(publisher.replay_endpoint, 0) == got + cleared  # a late subscriber catches up
    assert replay(publisher.replay_endpoint, len(got)) == cleared
    assert not state_sub.poll(200)  # a dense model has no state stream
    llm.engine.close()
    sub.close()
    state_sub.close()


def test_a_hybrid_engine_announces_its_state_checkpoints_on_the_state_topic(hybrid_models):
    from hyprefix import SamplingParams

    llm = _engine_with_events(hybrid_models["nemotron_h"][0])
    publisher = llm.engine.event_publisher
    kv_sub = _subscribe(publisher.endpoint, "kv-events")
    state_sub = _subscribe(publisher.endpoint, "hybrid-state")
    import time

    time.sleep(0.3)
    prompt = list(range(3, 52))  # 49 tokens: three full blocks
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
                 use_tqdm=False)
    index = PrefixIndex()
    kv = _receive(kv_sub, lambda ev: sum(len(e.block_hashes) for e in ev if isinstance(e, BlockStored)) >= 3)
    state = _receive(state_sub, lambda ev: any(isinstance(e, StateStored) for e in ev))
    for _, payload in kv + state:
        index.apply(decode_batch(payload)[1])
    expected: list[bytes] = []
    hashing.extend_hashes(expected, hashing.root_hash(llm.engine.model_identity, None), prompt, 16)
    assert index.hybrid and index.cached_blocks(expected) == 3
    assert index.states and index.states <= set(expected)  # checkpoints sit on announced blocks
    # what the subscriber learnt is what the engine holds
    pool = llm.engine.cache.kv.pool
    assert index.blocks == set(pool._hash_index)
    assert replay(publisher.replay_endpoint, 0, "hybrid-state") == state
    llm.engine.close()
    kv_sub.close()
    state_sub.close()
