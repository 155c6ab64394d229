"""Token hit rate of the KV block eviction policies (--kv-cache-eviction-policy) on a tiny
random-weight model under a small KV pool: deterministic counts, no timings, so it may run on a
busy machine. The workloads (chat, docs, churn) and the hit rates are those of
``tools/bench/checkpoint_policy.py`` (imported, not copied): here the KV pool binds, through
``--num-kv-blocks``, and a hybrid keeps a large checkpoint pool.

Prints a markdown table: one row per model, workload, pool size and policy.

    python tools/bench/kv_eviction_policy.py --capacities 96 160 256

``--alloc-cost`` instead prints the pool's own cost per allocated block under each policy, in
microseconds (plain Python, no model): a pool of ``--alloc-blocks`` blocks in a steady state of
chains published, released tail first and hit again. That one is a timing: run it on a quiet
machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hyprefix import LLM  # noqa: E402
from hyprefix.cache.block_pool import BlockPool  # noqa: E402
from hyprefix.cache.checkpoint_policy import RecomputeCost  # noqa: E402
from hyprefix.cache.kv_eviction import POLICIES, KVEvictionPolicy  # noqa: E402
from tools.bench.checkpoint_policy import add_workload_arguments, drive  # noqa: E402


def run(args: argparse.Namespace, model: str, workload: str, capacity: int, policy: str) -> dict[str, float]:
    llm = LLM(model, dtype="float32", enforce_eager=True, num_kv_blocks=capacity, max_num_seqs=args.max_num_seqs,
              kv_cache_eviction_policy=policy, max_state_checkpoints=args.checkpoints, log_stats_interval=0)
    if args.window is not None and policy == "cost-aware":
        book = llm.engine.scheduler.cache.kv.pool._chains
        book.policy = dataclasses.replace(book.policy, window=args.window)
    result = drive(llm, args, workload)
    stats = llm.get_stats()
    result["preempted"] = stats["num_preemptions"]
    return result


def alloc_cost(num_blocks: int, policy: str, rounds: int, seed: int = 0) -> float:
    """Microseconds per allocated block (``BlockPool.allocate`` alone) in a steady state: each
    round allocates a chain of 1-32 blocks, half the time under a cached prefix it hits (its
    blocks acquired), publishes it block by block with its parent, and releases it tail first."""
    rng = random.Random(seed)
    eviction = KVEvictionPolicy(policy, RecomputeCost(1.0, 1.0))
    pool = BlockPool(num_blocks, eviction=eviction)
    prefixes: list[list[int]] = []  # chains published so far (block ids, maybe evicted since)
    spent, allocated, serial = 0.0, 0, 0
    for r in range(rounds):
        prefix: list[int] = []
        if prefixes and rng.random() < 0.5:
            for block_id in rng.choice(prefixes)[:rng.randint(1, 16)]:
                if pool.blocks[block_id].block_hash is None:
                    break
                prefix.append(block_id)  # a hit (a block reused since has lost its hash: the hit stops)
        pool.acquire(prefix)
        n = rng.randint(1, 32)
        t0 = time.perf_counter()
        fresh = pool.allocate(n)
        spent += time.perf_counter() - t0
        assert fresh is not None
        allocated += n
        parent = prefix[-1] if prefix else None
        for i, block_id in enumerate(fresh, len(prefix)):
            serial += 1
            pool.publish(block_id, serial.to_bytes(8, "little"), parent, i)
            parent = block_id
        prefixes = [*prefixes[-64:], prefix + fresh]
        pool.release(list(reversed(prefix + fresh)))
        if r == rounds // 10:  # past the warm-up: the pool full of cached chains
            spent, allocated = 0.0, 0
    return 1e6 * spent / allocated


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--models", nargs="+", default=["demo-dense-tiny"],
                   help="models (random-weight demos by default; demo-hybrid-tiny adds the hybrid)")
    p.add_argument("--workloads", nargs="+", default=["chat", "docs", "churn"], choices=["chat", "docs", "churn"],
                   help="which workloads to run")
    p.add_argument("--capacities", nargs="+", type=int, default=[96, 160, 256], help="KV pool blocks (--num-kv-blocks)")
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES, help="--kv-cache-eviction-policy")
    p.add_argument("--window", type=int, default=None,
                   help="cost-aware: the least recently freed leaves it weighs (default: kv_eviction.DEFAULT_WINDOW)")
    p.add_argument("--checkpoints", type=int, default=4096,
                   help="hybrids: state checkpoint slots (large: the KV pool binds)")
    p.add_argument("--alloc-cost", action="store_true", help="print the pool's cost per allocated block instead")
    p.add_argument("--alloc-blocks", type=int, default=4096, help="--alloc-cost: the pool's blocks")
    p.add_argument("--alloc-rounds", type=int, default=20000, help="--alloc-cost: chains allocated")
    add_workload_arguments(p)
    p.set_defaults(max_num_seqs=4)
    args = p.parse_args(argv)
    if args.alloc_cost:
        print("| policy | pool blocks | µs per allocated block |")
        print("| --- | ---: | ---: |")
        for policy in args.policies:
            cost = alloc_cost(args.alloc_blocks, policy, args.alloc_rounds, args.seed)
            print(f"| {policy} | {args.alloc_blocks} | {cost:.2f} |", flush=True)
        return 0
    print("| model | workload | KV blocks | policy | token hit rate | long requests' hit rate | preemptions |")
    print("| --- | --- | ---: | --- | ---: | ---: | ---: |")
    for model in args.models:
        for workload in args.workloads:
            for capacity in args.capacities:
                for policy in args.policies:
                    r = run(args, model, workload, capacity, policy)
                    print(f"| {model} | {workload} | {capacity} | {policy} | {100 * r['hit']:.1f} % | "
                          f"{100 * r['long']:.1f} % | {r['preempted']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
