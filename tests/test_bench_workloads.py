"""The prefix-cache benchmark workloads: generators, report maths on synthetic timings, and
one end-to-end run of each workload on the tiny demo models (structure and hit rates, never
timings)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hyprefix.bench.arms import DecodeTiming, PrefillTiming
from hyprefix.bench.offline import RequestRecord, WorkloadRun
from hyprefix.bench.prefix import COMPARE_ARM, distribution, percentile, summarise
from hyprefix.bench.throughput import TARGETS as THROUGHPUT_TARGETS
from hyprefix.bench.throughput import ThroughputConfig, split_arm
from hyprefix.bench.throughput import summarise as summarise_throughput
from hyprefix.bench.workloads import (
    TOKEN_HIGH,
    TOKEN_LOW,
    MultiTurnWorkload,
    RandomWorkload,
    RlBurstWorkload,
    SharedPrefixWorkload,
)
from hyprefix.cli import main
from hyprefix.demo import demo_model_path
from hyprefix.hardware import device_caps


def _in_range(ids: tuple[int, ...]) -> bool:
    return all(TOKEN_LOW <= t < TOKEN_HIGH for t in ids)


# ----------------------------------------------------------------------- generators
def test_shared_prefix_shapes() -> None:
    w = SharedPrefixWorkload(groups=1, num_requests=5, system_len=40, suffix_len=7, output_len=3, seed=1)
    reqs = w.round_requests(0)
    assert len(reqs) == 5 == w.num_requests_total()
    assert all(len(r.prompt) == 47 and r.max_tokens == 3 and r.greedy and _in_range(r.prompt) for r in reqs)
    assert len({r.prompt[:40] for r in reqs}) == 1  # one shared system prompt
    assert len({r.prompt[40:] for r in reqs}) == 5  # unique suffixes
    assert w.prompt_lens() == [[47] * 5]
    assert w.ideal_prefill_tokens() == 40 + 5 * 7
    with pytest.raises(IndexError):
        w.round_requests(1)


def test_shared_prefix_groups() -> None:
    w = SharedPrefixWorkload(num_requests=3, system_len=32, suffix_len=4, groups=2)
    reqs = w.round_requests(0)
    assert len(reqs) == 6 and [r.group for r in reqs] == [0, 0, 0, 1, 1, 1]
    assert {r.prompt[:32] for r in reqs[:3]} != {r.prompt[:32] for r in reqs[3:]}
    assert len({r.prompt[:32] for r in reqs}) == 2
    assert w.ideal_prefill_tokens() == 2 * (32 + 3 * 4)


def test_default_parameters() -> None:
    sp = SharedPrefixWorkload().round_requests(0)
    assert len(sp) == 4 * 8 and len(sp[0].prompt) == 1024 + 64 and sp[0].max_tokens == 16
    rl = RlBurstWorkload().round_requests(0)
    assert len(rl) == 8 and len(rl[0].prompt) == 512 and rl[0].max_tokens == 32
    mt = MultiTurnWorkload()
    assert (mt.conversations, mt.turns, mt.system_len, mt.message_len, mt.output_len) == (4, 6, 256, 64, 32)


def test_rl_burst_shapes() -> None:
    w = RlBurstWorkload(num_prompts=2, num_samples=3, prompt_len=20, output_len=5, seed=4)
    reqs = w.round_requests(0)
    assert len(reqs) == 6 and all(len(r.prompt) == 20 and _in_range(r.prompt) for r in reqs)
    assert len({r.prompt for r in reqs[:3]}) == 1 and len({r.prompt for r in reqs[3:]}) == 1
    assert reqs[0].prompt != reqs[3].prompt
    assert all(r.temperature == 1.0 and not r.greedy for r in reqs)
    assert len({r.seed for r in reqs}) == 6  # samples differ
    assert w.ideal_prefill_tokens() == 40 and not w.greedy
    with pytest.raises(ValueError):
        RlBurstWorkload(temperature=0)


def test_random_workload_shapes() -> None:
    w = RandomWorkload(num_requests=50, prompt_len=40, range_ratio=0.25, output_len=2, seed=3)
    reqs = w.round_requests(0)
    lens = [len(r.prompt) for r in reqs]
    assert len(reqs) == 50 and all(30 <= n <= 50 for n in lens) and len(set(lens)) > 5
    assert w.prompt_lens() == [lens] and w.ideal_prefill_tokens() == sum(lens)
    assert len({r.prompt[:8] for r in reqs}) == 50 and all(r.greedy and _in_range(r.prompt) for r in reqs)
    assert [len(r.prompt) for r in RandomWorkload(num_requests=3, prompt_len=7, range_ratio=0).round_requests(0)] \
        == [7, 7, 7]
    with pytest.raises(ValueError):
        RandomWorkload(range_ratio=1.0)


@pytest.mark.parametrize("cls", [SharedPrefixWorkload, RlBurstWorkload, MultiTurnWorkload, RandomWorkload])
def test_determinism_by_seed(cls) -> None:
    a, b, c = cls(seed=7), cls(seed=7), cls(seed=8)
    assert a.round_requests(0) == b.round_requests(0)
    assert a.round_requests(0) != c.round_requests(0)
    assert a.with_seed(8).round_requests(0) == c.round_requests(0)


def test_multi_turn_extends_previous_prompt_and_answer() -> None:
    w = MultiTurnWorkload(conversations=3, turns=4, system_len=32, message_len=8, output_len=5, seed=2)
    assert w.num_rounds == 4 and w.num_requests_total() == 12
    prev = w.round_requests(0)
    assert [len(r.prompt) for r in prev] == [40] * 3
    assert all(r.prompt[:32] == w.system_prompt and r.prompt[32:] == w.message(c, 0) for c, r in enumerate(prev))
    assert len({w.message(c, 0) for c in range(3)}) == 3
    lens = w.prompt_lens()
    for k in range(1, 4):
        answers = [[100 * k + c + i for i in range(5)] for c in range(3)]
        cur = w.round_requests(k, prev, answers)
        for c, (p, r) in enumerate(zip(prev, cur, strict=True)):
            assert r.prompt == p.prompt + tuple(answers[c]) + w.message(c, k)
            assert r.group == c and r.tag == f"c{c}/t{k}"
        assert [len(r.prompt) for r in cur] == lens[k]
        prev = cur
    with pytest.raises(ValueError):
        w.round_requests(1, prev[:2], [[1]] * 2)
    with pytest.raises(IndexError):
        w.round_requests(4, prev, [[1]] * 3)


def test_invalid_parameters() -> None:
    for bad in ({"num_requests": 0}, {"system_len": -1}, {"output_len": 0}):
        with pytest.raises(ValueError):
            SharedPrefixWorkload(**bad)
    with pytest.raises(ValueError):
        MultiTurnWorkload(turns=0)


# ------------------------------------------------------------------- report maths
def test_percentile() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)
    d = distribution([1.0, None, 3.0])  # type: ignore[list-item]
    assert d["count"] == 2 and d["p50"] == pytest.approx(2.0) and d["mean"] == pytest.approx(2.0)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def _run(arm: str, seconds: float, ttfts: list[float], computed: int, skipped: int, repeat: int = 0) -> WorkloadRun:
    records = [RequestRecord(tag=f"r{i}", round=0, prompt_len=10, output_ids=[5, 6, 7], ttft=t, e2e=t + 1,
                             tpot=0.5) for i, t in enumerate(ttfts)]
    stats = {"prefix_cache_queries": computed + skipped, "prefix_cache_hits": skipped,
             "prefix_cache_hit_rate": skipped / (computed + skipped), "prefill_computed_tokens": computed,
             "prefill_skipped_tokens": skipped, "sibling_waits": 0, "num_preemptions": 0,
             "hybrid_hit_tokens_lost": 0, "mamba_checkpoints_used": 0, "mamba_checkpoints_capacity": 0}
    return WorkloadRun(arm=arm, repeat=repeat, seconds=seconds, round_seconds=[seconds], requests=records,
                       stats=stats)


def test_summary_ratios_on_synthetic_timings() -> None:
    w = RlBurstWorkload(num_prompts=1, num_samples=4, prompt_len=10, output_len=3)
    runs = {
        "hyprefix": [_run("hyprefix", 2.0, [0.1, 0.2, 0.3, 0.4], 10, 30),
                     _run("hyprefix", 4.0, [0.1, 0.2, 0.3, 0.4], 10, 30, 1),
                     _run("hyprefix", 3.0, [0.1, 0.2, 0.3, 0.4], 10, 30, 2)],
        "hyprefix-nocache": [_run("hyprefix-nocache", 9.0, [1.0, 1.0, 1.0, 1.0], 40, 0, r) for r in range(3)],
        COMPARE_ARM: [_run(COMPARE_ARM, 1.0, [0.1] * 4, 12, 28, r) for r in range(3)],
    }
    s = summarise(runs, w, {"hyprefix": "a", "hyprefix-nocache": "a", COMPARE_ARM: "b"})
    h = s["arms"]["hyprefix"]
    assert h["total_seconds"]["median"] == 3.0 and h["total_seconds"]["min"] == 2.0
    assert h["requests"] == 4 and h["output_tokens"] == 12
    assert h["requests_per_s"]["median"] == pytest.approx(4 / 3) and h["output_tokens_per_s"]["max"] == 6.0
    assert h["ttft_seconds"]["count"] == 12 and h["ttft_seconds"]["p50"] == pytest.approx(0.25)
    assert h["computed_vs_ideal"] == pytest.approx(1.0) and h["stats_identical_across_repeats"]
    ratios = {r["name"]: r for r in s["ratios"]}
    assert ratios["time hyprefix-nocache / hyprefix"]["value"] == pytest.approx(3.0)
    assert ratios["TTFT p50 hyprefix-nocache / hyprefix"]["value"] == pytest.approx(4.0)
    assert ratios["prefill computed / ideal (hyprefix)"]["pass"] is True
    assert ratios[f"prefill computed / ideal ({COMPARE_ARM})"]["pass"] is False  # 12 / 10 > 1.1
    hit = s["hit_rate_comparison"]
    assert hit["ratio"] == pytest.approx(0.75 / 0.7) and hit["pass"] is True
    assert s["output_agreement"] == [{"arms": ["hyprefix", "hyprefix-nocache"], "of": 4, "identical": 4,
                                      "same_first_token": 4, "first_difference_at": {}}]


def test_shared_prefix_target_and_failing_hit_rate() -> None:
    w = SharedPrefixWorkload(num_requests=4, system_len=8, suffix_len=2, output_len=3)
    runs = {"hyprefix": [_run("hyprefix", 2.0, [0.1] * 4, 30, 10)],
            "hyprefix-nocache": [_run("hyprefix-nocache", 5.0, [0.5] * 4, 40, 0)],
            COMPARE_ARM: [_run(COMPARE_ARM, 2.0, [0.1] * 4, 10, 30)]}
    s = summarise(runs, w, {})
    speedup = next(r for r in s["ratios"] if r["name"] == "time hyprefix-nocache / hyprefix")
    assert speedup["value"] == pytest.approx(2.5) and speedup["target"] == 3.0 and speedup["pass"] is False
    assert s["hit_rate_comparison"]["ratio"] == pytest.approx(0.25 / 0.75)
    assert s["hit_rate_comparison"]["pass"] is False


def test_flags_of_another_workload_are_refused(capsys) -> None:
    assert main(["bench", "--workload", "shared-prefix", "--turns", "3"]) == 2
    assert "--turns" in capsys.readouterr().err
    assert main(["bench", "--workload", "throughput", "--num-samples", "3"]) == 2
    assert main(["bench", "--workload", "multi-turn", "--arms", "hyprefix-nocache", "--compare-model", "x"]) == 2
    assert main(["bench", "--workload", "rl-burst", "--arms", "hyprefix,vllm"]) == 2


# ------------------------------------------------------------------------ end to end
TINY = ["--dtype", "float32", "--repeats", "1", "--enforce-eager", "--arms", "hyprefix,hyprefix-nocache",
        "--kv-cache-memory-gb", "0.02", "--mamba-cache-memory-gb", "0.01"]
CASES = {
    "shared-prefix": ["--model", "demo-hybrid-tiny", "--num-requests", "4", "--system-len", "48", "--suffix-len", "8",
                      "--output-len", "3"],
    "rl-burst": ["--model", "demo-hybrid-tiny", "--num-prompts", "1", "--num-samples", "4", "--prompt-len", "48",
                 "--output-len", "3"],
    "multi-turn": ["--model", "demo-hybrid-tiny", "--compare-model", "demo-dense-tiny", "--conversations", "2",
                   "--turns", "3", "--system-len", "32", "--message-len", "16", "--output-len", "3"],
    "random": ["--model", "demo-dense-tiny", "--num-requests", "4", "--prompt-len", "24", "--output-len", "3"],
}


@pytest.mark.parametrize("workload", list(CASES))
def test_end_to_end(workload: str, tmp_path: Path, capsys) -> None:
    out = tmp_path / "bench.json"
    assert main(["--log-level", "WARNING", "bench", "--workload", workload, *CASES[workload], *TINY,
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"--workload {workload}" in printed and "prefix hit rate" in printed
    result = json.loads(out.read_text())
    assert result["workload"] == workload
    expected = ["hyprefix", "hyprefix-nocache", *([COMPARE_ARM] if workload == "multi-turn" else [])]
    assert result["arm_order"] == expected and set(result["arms"]) == set(expected)
    total = result["workload_config"]["num_requests_total"]
    for name in expected:
        arm = result["arms"][name]
        assert arm["requests"] == total and arm["output_tokens"] == total * 3
        assert arm["ttft_seconds"]["count"] == total
        assert 0.0 <= arm["stats"]["prefix_cache_hit_rate"] <= 1.0
        assert arm["stats"]["cache_at_start"] == {"kv_blocks_cached": 0, "mamba_checkpoints_used": 0}
        assert arm["peak_rss_growth_gib"] is not None and arm["peak_rss_growth_gib"] >= 0
        assert result["arm_info"][name]["memory_bytes"]["weights"] > 0
    assert "memory: weights + pools (GiB)" in printed
    cache, nocache = result["arms"]["hyprefix"]["stats"], result["arms"]["hyprefix-nocache"]["stats"]
    if workload == "random":  # nothing to share: both arms compute every prompt token
        ideal = result["workload_config"]["ideal_prefill_tokens"]
        assert cache["prefill_computed_tokens"] == nocache["prefill_computed_tokens"] == ideal
        assert result["output_agreement"][0]["identical"] == total
        return
    assert cache["prefill_skipped_tokens"] > 0 and cache["prefix_cache_hit_rate"] > 0
    assert nocache["prefill_skipped_tokens"] == 0 and nocache["prefix_cache_hits"] == 0
    assert cache["prefill_computed_tokens"] < nocache["prefill_computed_tokens"]
    if workload == "rl-burst":  # the 48-token prompt once, then only the last token per sibling
        assert cache["prefill_computed_tokens"] == 48 + 3
    agreement = result["output_agreement"][0]
    assert agreement["arms"] == ["hyprefix", "hyprefix-nocache"] and agreement["of"] == total
    if workload != "rl-burst":  # greedy: caching on and off give the same tokens (float32)
        assert agreement["identical"] == total
    if workload == "multi-turn":
        hit = result["hit_rate_comparison"]
        assert hit["compare_model"] == "demo-dense-tiny" and 0 < hit["compare_hit_rate"] <= 1
        assert hit["ratio"] == pytest.approx(hit["hit_rate"] / hit["compare_hit_rate"])
        assert "PASS" in printed or "FAIL" in printed


def test_bench_kv_pool_holds_the_whole_workload() -> None:
    from hyprefix.bench.prefix import workload_kv_blocks

    w = SharedPrefixWorkload(groups=2, num_requests=3, system_len=30, suffix_len=4, output_len=3)
    assert workload_kv_blocks(w, block_size=16) == 6 * 3  # 37 tokens -> 3 blocks each
    mt = MultiTurnWorkload(conversations=1, turns=2, system_len=10, message_len=5, output_len=2)
    assert workload_kv_blocks(mt, block_size=4) == 5 + 6  # turns of 15+2 and 22+2 tokens


def _timings(prefill: float, decode: dict[int, float]) -> dict[str, list]:
    """One repeat of a throughput arm: ``prefill`` tok/s (1000 tokens) and decode tok/s per batch."""
    runs: dict[str, list] = {"prefill": [PrefillTiming(prompt_len=1000, seconds=1000 / prefill, first_token=1)]}
    for b, tps in decode.items():
        runs[f"decode@{b}"] = [DecodeTiming(batch=b, prompt_len=8, new_tokens=11, total_seconds=2.0,
                                            prefill_seconds=1.0, decode_seconds=10 * b / tps, decode_tokens=10 * b,
                                            steps=11, token_ids=[[1] * 11] * b)]
    return runs


@pytest.mark.parametrize("cpu_kind", list(THROUGHPUT_TARGETS))
def test_throughput_targets_follow_the_cpu_kind(cpu_kind: str) -> None:
    cfg = ThroughputConfig(batch_sizes=(1, 16), repeats=1,
                           arms=("hyprefix", "transformers", "hyprefix@bfloat16", "hyprefix@float32"))
    runs = {"hyprefix": _timings(120.0, {1: 6.0, 16: 48.0}), "transformers": _timings(100.0, {1: 5.0, 16: 30.0}),
            "hyprefix@bfloat16": _timings(20.0, {1: 9.0, 16: 10.0}),
            "hyprefix@float32": _timings(125.0, {1: 6.0, 16: 48.0})}
    s = summarise_throughput(runs, str(demo_model_path("dense", "tiny")), cfg, None, cpu_kind)
    by_name = {r["name"]: r for r in s["ratios"]}
    assert s["targets"] == cpu_kind
    for label, _, _, target in THROUGHPUT_TARGETS[cpu_kind]:
        assert by_name[label]["target"] == target
    assert by_name["prefill hyprefix / transformers"]["value"] == pytest.approx(1.2)
    same_batch = by_name["decode hyprefix B=16 / transformers B=16"]
    assert same_batch["value"] == pytest.approx(1.6)
    assert same_batch["target"] == (1.5 if cpu_kind == "no-native-bf16" else None)
    auto = by_name["prefill hyprefix / fastest explicit dtype (hyprefix@float32)"]
    assert auto["value"] == pytest.approx(120 / 125) and auto["target"] == 0.9 and auto["pass"] is True


def test_throughput_arms_may_name_a_dtype() -> None:
    assert split_arm("hyprefix@float32") == ("hyprefix", "float32") and split_arm("transformers") == (
        "transformers", None)
    ThroughputConfig(arms=("hyprefix", "hyprefix@bfloat16", "transformers@float32"))
    for bad in (("hyprefix@int8",), ("vllm@float32",), ("hyprefix", "hyprefix")):
        with pytest.raises(ValueError, match="arms must be"):
            ThroughputConfig(arms=bad)


def test_throughput_end_to_end(tmp_path: Path, capsys) -> None:
    out = tmp_path / "throughput.json"
    assert main(["--log-level", "WARNING", "bench", "--workload", "throughput", "--model", "demo-dense-tiny",
                 "--repeats", "1", "--prompt-len", "24", "--decode-prompt-len", "8", "--arms",
                 "hyprefix,transformers,hyprefix@float32",
                 "--decode-tokens", "3", "--batch-sizes", "1,2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "prefill hyprefix / transformers" in printed and "(auto -> float32)" in printed  # float32 checkpoint
    result = json.loads(out.read_text())
    assert result["peak"]["gflops"] > 0 and result["peak"]["dtype"] == "float32"
    assert result["peak"]["path"] in (("plain", "prepacked") if device_caps("cpu").prepack(torch.float32)
                                      else ("plain",))
    assert result["peak"]["gflops"] >= result["peak"]["plain_gflops"]
    assert result["environment"]["device_caps"] == device_caps("cpu").to_dict()
    assert result["arm_info"]["hyprefix"]["dtype"] == result["arm_info"]["transformers"]["dtype"] == "float32"
    assert any(r["name"].startswith("prefill hyprefix / fastest explicit dtype") for r in result["ratios"])
    medians = result["medians_tokens_per_s"]
    assert set(medians) == {"hyprefix", "transformers", "hyprefix@float32"}
    for arm in medians.values():
        assert set(arm) == {"prefill", "decode@1", "decode@2"} and all(v > 0 for v in arm.values())
    names = [r["name"] for r in result["ratios"]]
    assert "prefill hyprefix / transformers" in names and "decode hyprefix B=1 / transformers B=1" in names
    assert result["prefill_peak"]["hyprefix"]["fraction_of_peak"] > 0
