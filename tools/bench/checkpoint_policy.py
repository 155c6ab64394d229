"""Token hit rate of the state-checkpoint eviction policies (--state-cache-eviction-policy) on a
tiny random-weight hybrid model under a small checkpoint pool: deterministic counts, no timings,
so it may run on a busy machine.

Workloads (token ids drawn from a seeded generator; greedy decoding, EOS ignored):
- chat: ``--conversations`` long conversations of ``--turns`` turns, each turn the previous
  prompt + answer + a new user message; each round sends the next turn of every conversation
  together with ``--oneoffs`` unique one-off prompts (shorter; they also take checkpoints: their
  last prompt boundary and their finish).
- docs: ``--conversations`` long documents, each asked ``--turns`` different short questions
  over the rounds (the document is a shared prefix: its checkpoint is the divergence point),
  with the same stream of one-off prompts.
- churn (where recency should win): each round starts a conversation and ends the previous
  round's after its second turn, so long checkpoints go stale, beside ``--conversations`` x
  ``--oneoffs`` short prompts drawn round robin from ``--hot`` that come back every few rounds.

The hit rate is the prefill tokens a prefix hit skipped over all prompt tokens
(``prefill_skipped_tokens / (prefill_skipped_tokens + prefill_computed_tokens)``); "long" is the
same over the conversations' / documents' requests alone (``RequestOutput.num_cached_tokens``).
Prints a markdown table: one row per workload, capacity and policy.

    python tools/bench/checkpoint_policy.py --capacities 8 16 32
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys

from hyprefix import LLM, SamplingParams
from hyprefix.cache.recurrent import RecurrentStateCache

VOCAB = (3, 4000)  # the demo tokenizer's ids past its special tokens


@dataclasses.dataclass(frozen=True)
class Arm:
    label: str
    policy: str  # --state-cache-eviction-policy
    alpha: float | None = None  # None: the default (checkpoint_policy.COST_AWARE_ALPHA)
    admission: bool = False


def parse_arm(text: str) -> Arm:
    """``lru``, ``cost-aware``, ``cost-aware:ALPHA`` or ``cost-aware:ALPHA:admit``."""
    name, *rest = text.split(":")
    alpha = float(rest[0]) if rest else None
    return Arm(text, name, alpha, len(rest) > 1 and rest[1] == "admit")


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*VOCAB) for _ in range(n)]


def rounds(args: argparse.Namespace, workload: str) -> list[list[tuple[bool, list[int] | int]]]:
    """Per round, the requests: (False, a short prompt) or (True, the index of a conversation or
    document) whose prompt is built when the round runs (a chat turn extends the last answer)."""
    rng, hot_rng = random.Random(args.seed), random.Random(args.seed + 2)
    hot = [tokens(hot_rng, hot_rng.randint(*args.oneoff_len)) for _ in range(args.hot)]
    out, shorts = [], 0
    for r in range(args.turns):
        # churn: conversation r starts, r - 1 has its second and last turn
        longs = [c for c in (r - 1, r) if c >= 0] if workload == "churn" else list(range(args.conversations))
        batch: list[tuple[bool, list[int] | int]] = []
        for c in longs:
            batch.append((True, c))
        for _ in range(args.conversations * args.oneoffs):
            if workload == "churn":  # the hot short prompts, round robin
                batch.append((False, hot[shorts % len(hot)]))
                shorts += 1
            else:
                batch.append((False, tokens(rng, rng.randint(*args.oneoff_len))))
        out.append(batch)
    return out


def run(args: argparse.Namespace, workload: str, capacity: int, arm: Arm) -> dict[str, float]:
    llm = LLM(args.model, dtype="float32", num_kv_blocks=args.kv_blocks, max_state_checkpoints=capacity,
              max_num_seqs=args.max_num_seqs, state_cache_eviction_policy=arm.policy, log_stats_interval=0)
    (kind,) = [k for k in llm.engine.scheduler.cache.kinds if isinstance(k, RecurrentStateCache)]
    pool = kind.pool
    if arm.alpha is not None or arm.admission:
        pool.policy = dataclasses.replace(pool.policy, alpha=pool.policy.alpha if arm.alpha is None else arm.alpha,
                                          admission=arm.admission)
    return drive(llm, args, workload)


def drive(llm: LLM, args: argparse.Namespace, workload: str) -> dict[str, float]:
    """Send ``workload``'s rounds to ``llm``; its token hit rate ("hit"), the long requests' ("long")
    and the prompt tokens ("prompt"). Also ``tools/bench/kv_eviction_policy.py``'s driver."""
    rng = random.Random(args.seed + 1)
    heads = [tokens(rng, args.first_len) for _ in range(max(args.conversations, args.turns))]
    history = [list(h) for h in heads]
    params = SamplingParams(temperature=0, max_tokens=args.answer_len, ignore_eos=True)
    long_prompt = long_cached = 0
    for batch in rounds(args, workload):
        prompts = []
        for is_long, item in batch:
            if not is_long:
                prompts.append(item)
            elif workload != "docs":
                history[item] += tokens(rng, args.user_len)
                prompts.append(history[item])
            else:  # docs: the document, then a question of its own
                prompts.append(heads[item] + tokens(rng, args.user_len))
        outs = llm.generate(prompts, params, use_tqdm=False)
        for (is_long, item), prompt, out in zip(batch, prompts, outs, strict=True):
            if is_long:
                long_prompt += len(prompt)
                long_cached += out.num_cached_tokens
                if workload != "docs":
                    history[item] = prompt + list(out.outputs[0].token_ids)
    llm.check_invariants()
    stats = llm.get_stats()
    skipped, computed = stats["prefill_skipped_tokens"], stats["prefill_computed_tokens"]
    return {"hit": skipped / max(1, skipped + computed), "long": long_cached / max(1, long_prompt),
            "prompt": skipped + computed}


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """The workloads' shape (``rounds``, ``drive``), shared with ``tools/bench/kv_eviction_policy.py``."""
    p.add_argument("--conversations", type=int, default=6, help="long conversations (chat) or documents (docs)")
    p.add_argument("--turns", type=int, default=6, help="rounds: turns of each conversation, questions per document")
    p.add_argument("--oneoffs", type=int, default=4, help="unique one-off prompts sent beside each long request")
    p.add_argument("--first-len", type=int, default=400, help="tokens of a conversation's first prompt / a document")
    p.add_argument("--user-len", type=int, default=40, help="tokens of each new user message / question")
    p.add_argument("--answer-len", type=int, default=24, help="tokens of each answer")
    p.add_argument("--oneoff-len", type=int, nargs=2, default=[40, 160], metavar=("MIN", "MAX"),
                   help="tokens of a one-off prompt, drawn uniformly")
    p.add_argument("--hot", type=int, default=16, help="churn: the short prompts repeated round robin")
    p.add_argument("--max-num-seqs", type=int, default=8, help="sequences running at once")
    p.add_argument("--seed", type=int, default=0, help="seed of the token ids")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="demo-hybrid-tiny", help="a hybrid model (random-weight demo by default)")
    p.add_argument("--workloads", nargs="+", default=["chat", "docs", "churn"], choices=["chat", "docs", "churn"],
                   help="which workloads to run")
    p.add_argument("--capacities", nargs="+", type=int, default=[8, 16, 32],
                   help="state checkpoint slots (--max-state-checkpoints)")
    p.add_argument("--arms", nargs="+", default=["lru", "cost-aware"],
                   help="policies: lru, cost-aware, cost-aware:ALPHA, cost-aware:ALPHA:admit (with the "
                        "admission rule)")
    p.add_argument("--kv-blocks", type=int, default=4096, help="KV pool blocks (large: the checkpoints bind)")
    add_workload_arguments(p)
    args = p.parse_args(argv)
    arms = [parse_arm(a) for a in args.arms]
    print("| workload | checkpoint slots | policy | token hit rate | long requests' hit rate |")
    print("| --- | ---: | --- | ---: | ---: |")
    for workload in args.workloads:
        for capacity in args.capacities:
            for arm in arms:
                r = run(args, workload, capacity, arm)
                print(f"| {workload} | {capacity} | {arm.label} | {100 * r['hit']:.1f} % | {100 * r['long']:.1f} % |",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
