"""The replica choice of the prefix-aware router, on plain data: block hashes, indexes
fed with cache events, loads."""

from __future__ import annotations

import pytest

from hyprefix.cache.events import BlockStored, StateStored
from hyprefix.routing.policy import PrefixRouter, RoutingRule


def chain(tag: int, n: int) -> list[bytes]:
    return [bytes([tag, i]) * 16 for i in range(n)]


def store(router: PrefixRouter, replica: str, hashes: list[bytes]) -> None:
    router.replica(replica).index.apply([BlockStored(hashes, None, [0] * 16 * len(hashes), 16)])


def test_the_longest_cached_prefix_wins_when_load_is_balanced():
    router = PrefixRouter()
    store(router, "a", chain(1, 2))
    store(router, "b", chain(1, 6))
    decision = router.choose(chain(1, 8), {"a": 0, "b": 3})
    assert (decision.ranking, decision.reason, decision.matched_blocks) == (["b", "a"], "prefix", 6)


def test_imbalanced_load_goes_to_the_least_loaded_replica():
    router = PrefixRouter(RoutingRule(balance_abs=4, balance_rel=1.5))
    store(router, "b", chain(1, 8))
    assert router.choose(chain(1, 8), {"a": 1, "b": 6}).ranking == ["a", "b"]
    assert router.choose(chain(1, 8), {"a": 1, "b": 5}).reason == "prefix"  # gap of 4 is not > 4


def test_a_short_match_does_not_outweigh_load_and_ties_rotate_so_none_starves():
    router = PrefixRouter(RoutingRule(min_match=0.5))
    store(router, "a", chain(1, 1))
    assert router.choose(chain(1, 4), {"a": 0, "b": 0, "c": 0}).reason == "least-loaded"
    firsts = [router.choose(chain(9, 4), {"a": 0, "b": 0, "c": 0}).ranking[0] for _ in range(6)]
    assert sorted(firsts) == ["a", "a", "b", "b", "c", "c"]


def test_a_burst_on_one_new_prefix_follows_its_first_request():
    router = PrefixRouter()
    loads = {"a": 0, "b": 0}
    first = None
    for i in range(8):
        decision = router.choose(chain(3, 10), loads)
        replica = decision.ranking[0]
        first = first or replica
        assert replica == first and (i == 0 or decision.reason == "prefix")
        router.routed(replica, f"r{i}", chain(3, 10))
        loads[replica] += 1
    # the in-flight blocks go when the requests end
    for i in range(8):
        router.finished(first, f"r{i}")
    assert router.replica(first).usable_blocks(chain(3, 10)) == 0


def test_a_hybrid_replica_counts_only_blocks_with_a_state_checkpoint():
    router = PrefixRouter()
    h = chain(5, 6)
    store(router, "kv-only", h)
    router.replica("kv-only").index.apply([StateStored([h[0]])])  # a checkpoint after block 0 only
    store(router, "checkpointed", h[:4])
    router.replica("checkpointed").index.apply([StateStored([h[3]])])
    decision = router.choose(h, {"kv-only": 0, "checkpointed": 0})
    assert decision.ranking[0] == "checkpointed" and decision.matched_blocks == 4


def test_no_replica_is_an_error():
    with pytest.raises(ValueError, match="no replica"):
        PrefixRouter().choose(chain(1, 2), {})
