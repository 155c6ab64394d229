"""The stress driver (``tests/support/stress_driver.py``: requests arriving a few per step, aborts,
multi-turn follow-ups, the invariants checked after every step) with the engine's other features on:
speculative decoding, structured outputs, a sliding-window pool, weight updates mid-run, and the disk
tier across a restart. Short runs for the suite; every finished request's greedy tokens equal an
engine's without prefix caching (and without the feature where it cannot change tokens)."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hyprefix import LLM, SamplingParams
from tests.support.compare import random_prompts
from tests.support.stress_driver import drive, verify

# A long run: HYPREFIX_STRESS_REQUESTS=500 python -m pytest tests/engine/test_stress_modes.py
NUM_REQUESTS = int(os.environ.get("HYPREFIX_STRESS_REQUESTS", "14"))
REPO = Path(__file__).resolve().parents[2]
BLOCK = 16


def _llm(path: Path, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 40)
    return LLM(str(path), dtype="float32", block_size=BLOCK, max_num_seqs=4, max_num_batched_tokens=48,
               log_stats_interval=0, **kwargs)


def _todo(rng: random.Random, params, repeat: bool = False) -> list[tuple[str, dict, SamplingParams]]:
    """Requests on two shared system prompts (so prefixes hit), each with its own tail; ``repeat``:
    tails that repeat a motif (so prompt lookup drafts)."""
    systems = random_prompts((37, 21), seed=rng.randrange(1000))
    todo = []
    for i in range(NUM_REQUESTS):
        tail = random_prompts((rng.randint(1, 30),), seed=rng.randrange(1000))[0]
        if repeat:
            tail = (tail[:6] * 5)[:rng.randint(12, 30)]
        todo.append((f"r{i}", {"prompt_token_ids": systems[i % 2] + tail}, params(rng)))
    return todo


def _greedy(rng: random.Random) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=rng.randint(1, 12), ignore_eos=True)


def _run(llm: LLM, ref: LLM, todo, seed: int, **kwargs):
    rng = random.Random(seed)
    run = drive(llm, rng, list(todo), block_size=BLOCK, max_prompt=300, abort_p=0.05, reset_step=-1, follow_p=0.4,
                follow_max_tokens=8, max_steps=max(2000, 150 * len(todo)), **kwargs)
    done = verify(llm, ref, run, len(todo))
    stats = llm.get_stats()
    print(f"stress: {len(run.added)} requests ({run.num_followups} follow-ups), {len(run.aborted)} aborted, "
          f"{len(done)} checked against no prefix caching; prefix hits {stats['prefix_cache_hits']} of "
          f"{stats['prefix_cache_queries']}, {stats['prefill_skipped_tokens']} prompt tokens skipped, "
          f"{stats['num_preemptions']} preemptions")  # (shown with -s: the long run's numbers)
    return run


def test_stress_with_speculative_decoding(qwen3_dir):
    """Prompt-lookup drafts on prompts that repeat a motif: drafts are made and verified, rejected
    ones give their blocks back, and the tokens are the greedy ones without speculation."""
    rng = random.Random(1)
    todo = _todo(rng, _greedy, repeat=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    llm = _llm(qwen3_dir, speculative_config=spec)
    _run(llm, _llm(qwen3_dir, enable_prefix_caching=False), todo, seed=1)
    assert llm.get_stats()["spec_decode_num_drafts"] > 0


def test_stress_with_structured_outputs(qwen3_dir):
    """A third of the requests constrained (a regex, a choice); their texts match; every request's
    tokens are those of the same constrained request without prefix caching."""
    choices = ["alpha", "beta", "gamma"]

    def params(rng: random.Random) -> SamplingParams:
        kind = rng.randrange(3)
        if kind == 0:
            return SamplingParams(temperature=0, max_tokens=12, structured_outputs={"regex": "[a-c]{2,6}"})
        if kind == 1:
            return SamplingParams(temperature=0, max_tokens=12, structured_outputs={"choice": choices})
        return _greedy(rng)

    rng = random.Random(2)
    todo = _todo(rng, params)
    llm = _llm(qwen3_dir)
    run = _run(llm, _llm(qwen3_dir, enable_prefix_caching=False), todo, seed=2)
    constrained = 0
    for rid, (_, p) in run.added.items():
        out = run.last[rid].outputs[0]
        if p.structured_outputs is None or out.finish_reason != "stop":
            continue
        constrained += 1
        spec = p.structured_outputs
        assert (re.fullmatch("[a-c]{2,6}", out.text) if spec.regex else out.text in choices), (rid, out.text)
    assert constrained > 0


def test_stress_with_a_sliding_window_pool(tiny_models):
    """Mistral with a 24-token window shorter than the context: its window layers have their own
    pool, whose blocks leave as the window passes them."""
    path = tiny_models["mistral"][0]
    llm = _llm(path, num_kv_blocks=30)
    assert llm.engine.runner.has_window_pool
    _run(llm, _llm(path, enable_prefix_caching=False), _todo(random.Random(3), _greedy), seed=3)


def test_stress_with_weight_updates(qwen3_dir):
    """The same checkpoint loaded again, twice, mid-run: each update is a new weight version, so
    nothing cached before it is hit after it, and the tokens stay the checkpoint's."""
    llm = _llm(qwen3_dir)
    versions = [llm.weight_version]

    def update() -> None:
        llm.update_weights(qwen3_dir)
        versions.append(llm.weight_version)

    _run(llm, _llm(qwen3_dir, enable_prefix_caching=False), _todo(random.Random(4), _greedy), seed=4,
         events={6: update, 14: update})
    assert len(set(versions)) == 3


# The first half of the disk run in a process of its own, killed (SIGKILL: no close, no exit hook)
# once its write-through writes are done; it checks its own tokens first.
KILLED_CHILD = r"""
import json, os, random, signal, sys
from tests.engine.test_stress_modes import NUM_REQUESTS, _llm, _run, _todo, _greedy
path, directory = sys.argv[1], sys.argv[2]
todo = _todo(random.Random(5), _greedy)
llm = _llm(path, num_kv_blocks=16, disk_cache_dir=directory, disk_cache_gb=0.1, disk_cache_write_through=True)
_run(llm, _llm(path, enable_prefix_caching=False), todo[:NUM_REQUESTS // 2], seed=5)
llm.engine.disk.tier.flush()
print(json.dumps(llm.get_stats()["disk_cache_bytes_written"]), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("end", ["close", "kill"])
def test_stress_with_the_disk_tier_across_a_restart(qwen3_dir, tmp_path, end):
    """A pool too small for the traffic spills blocks to the disk tier; the engine ends (closed, or
    its process killed with write-through on) and a new one on the same directory serves the rest,
    its shared prefixes read back from disk."""
    disk = tmp_path / "disk"
    ref = _llm(qwen3_dir, enable_prefix_caching=False)
    todo = _todo(random.Random(5), _greedy)
    if end == "close":
        first = _llm(qwen3_dir, num_kv_blocks=16, disk_cache_dir=str(disk), disk_cache_gb=0.1)
        _run(first, ref, todo[:NUM_REQUESTS // 2], seed=5)
        assert first.get_stats()["disk_cache_bytes_written"] > 0
        first.engine.close()
    else:
        script = tmp_path / "killed.py"
        script.write_text(KILLED_CHILD)
        proc = subprocess.run([sys.executable, str(script), str(qwen3_dir), str(disk)], cwd=REPO,
                              env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
        assert json.loads(proc.stdout.strip().splitlines()[-1]) > 0  # it wrote, then died unclosed
    second = _llm(qwen3_dir, num_kv_blocks=16, disk_cache_dir=str(disk), disk_cache_gb=0.1)
    _run(second, ref, todo[NUM_REQUESTS // 2:], seed=6)
    assert second.get_stats()["disk_cache_hit_tokens"] > 0
