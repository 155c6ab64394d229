"""A router learns what each replica holds from the replicas' own KV event streams:
two real engines (tiny Llama) publishing over loopback ZMQ, one subscriber."""

from __future__ import annotations

import time

from hyprefix import LLM, SamplingParams
from hyprefix.cache import hashing
from hyprefix.routing.policy import PrefixRouter
from hyprefix.routing.subscriber import EventSubscriber, ReplicaEndpoints

EVENTS = '{"endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"}'
GREEDY = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)


def endpoints(llm: LLM) -> ReplicaEndpoints:
    publisher = llm.engine.event_publisher
    return ReplicaEndpoints(publisher.endpoint, publisher.replay_endpoint)


def wait_for(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def test_the_router_follows_each_replicas_events_and_catches_up_by_replay(tiny_models):
    path = str(tiny_models["llama"][0])
    a = LLM(path, dtype="float32", num_kv_blocks=64, enforce_eager=True, kv_events_config=EVENTS)
    b = LLM(path, dtype="float32", num_kv_blocks=64, enforce_eager=True, kv_events_config=EVENTS)
    assert a.engine.model_identity == b.engine.model_identity
    root = hashing.root_hash(a.engine.model_identity, None)
    early, late = list(range(3, 70)), list(range(500, 560))
    a.generate([{"prompt_token_ids": early}], GREEDY, use_tqdm=False)  # before anyone listens

    router = PrefixRouter()
    subscriber = EventSubscriber(router)
    try:
        subscriber.add("a", endpoints(a))
        subscriber.add("b", endpoints(b))
        want_early: list[bytes] = []
        hashing.extend_hashes(want_early, root, early, 16)
        assert wait_for(lambda: router.replica("a").index.cached_blocks(want_early) == 4)  # from the replay
        b.generate([{"prompt_token_ids": late}], GREEDY, use_tqdm=False)
        want_late: list[bytes] = []
        hashing.extend_hashes(want_late, root, late, 16)
        assert wait_for(lambda: router.replica("b").index.cached_blocks(want_late) == 3)
        loads = {"a": 0, "b": 0}
        with subscriber.lock:
            assert router.choose([*want_late, b"x" * 32], loads).ranking[0] == "b"
            assert router.choose(want_early, loads).ranking[0] == "a"
        b.reset_prefix_cache()
        assert wait_for(lambda: not router.replica("b").index.blocks)
        subscriber.remove("a")
        assert wait_for(lambda: "a" not in router.replicas)
    finally:
        subscriber.close()
        a.engine.close()
        b.engine.close()
