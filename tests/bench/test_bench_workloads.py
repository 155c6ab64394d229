"""The benchmark workloads: generators, summary maths on synthetic timings, and one
end-to-end run of each workload on the tiny demo models (structure, token counts and hit
rates, never timings)."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hyprefix.bench import env
from hyprefix.bench.arms import (
    COMPARE_ARM,
    RequestRecord,
    WorkloadRun,
    arm_kv_cache_dtype,
    check_arm_names,
    split_arm,
    workload_kv_blocks,
)
from hyprefix.bench.summary import distribution, percentile, prefill_flops, summarise
from hyprefix.bench.workloads import (
    DEFAULT_VOCAB,
    TOKEN_LOW,
    MultiTurnWorkload,
    RandomWorkload,
    RlBurstWorkload,
    SharedPrefixWorkload,
    ThroughputWorkload,
)
from hyprefix.cli import main
from hyprefix.hardware import device_caps


def _in_range(ids: tuple[int, ...], high: int = DEFAULT_VOCAB) -> bool:
    return all(TOKEN_LOW <= t < high for t in ids)


# ----------------------------------------------------------------------- generators
def test_shared_prefix_shapes() -> None:
    w = SharedPrefixWorkload(groups=1, num_requests=5, system_len=40, suffix_len=7, output_len=3, seed=1)
    reqs = w.round_requests(0)
    assert len(reqs) == 5 and w.prompt_lens() == [[47] * 5]
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
    assert replace(a, seed=8).round_requests(0) == c.round_requests(0)


def test_multi_turn_extends_previous_prompt_and_answer() -> None:
    w = MultiTurnWorkload(conversations=3, turns=4, system_len=32, message_len=8, output_len=5, seed=2)
    assert w.num_rounds == 4 and sum(map(len, w.prompt_lens())) == 12
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



def test_token_ids_follow_the_vocabulary() -> None:
    for cls in (SharedPrefixWorkload, RlBurstWorkload, MultiTurnWorkload, RandomWorkload):
        w = cls(vocab_size=40)
        assert all(_in_range(r.prompt, 40) for r in w.round_requests(0)) and w.to_dict()["token_range"] == [3, 40]
    big = [t for r in RandomWorkload(vocab_size=151936).round_requests(0) for t in r.prompt]
    assert max(big) >= DEFAULT_VOCAB  # the whole vocabulary is drawn from, not only the demo tokenizer's
    with pytest.raises(ValueError, match="vocab-size"):
        RandomWorkload(vocab_size=3)


def test_throughput_cases() -> None:
    w = ThroughputWorkload(prompt_len=20, decode_prompt_len=6, decode_tokens=4, batch_sizes=(1, 3), vocab_size=50)
    cases = w.cases()
    assert list(cases) == ["prefill", "decode@1", "decode@3"]
    prefill, batch3 = cases["prefill"].round_requests(0), cases["decode@3"].round_requests(0)
    assert [(len(r.prompt), r.max_tokens) for r in prefill] == [(20, 1)]
    assert [(len(r.prompt), r.max_tokens) for r in batch3] == [(6, 4)] * 3
    assert all(r.greedy and _in_range(r.prompt, 50) for r in prefill + batch3)
    assert cases["decode@3"].for_repeat(1).round_requests(0) != batch3  # fresh prompts every repeat
    assert cases["decode@3"].for_repeat(0).round_requests(0) == batch3
    assert w.engine_defaults() == {"max_num_batched_tokens": 2048}
    assert ThroughputWorkload(prompt_len=3000).engine_defaults() == {"max_num_batched_tokens": 3000}
    assert workload_kv_blocks(w, block_size=16) == 3  # decode@3: three 10-token requests; prefill: 21 -> 2
    with pytest.raises(ValueError, match="decode-tokens"):
        ThroughputWorkload(decode_tokens=1)


def test_arm_names() -> None:
    assert split_arm("hyprefix@float32") == ("hyprefix", "float32") and split_arm("transformers") == (
        "transformers", None)
    check_arm_names(["hyprefix", "hyprefix@bfloat16", "transformers@float32"], ["hyprefix", "transformers"])
    for bad in (["hyprefix@int8"], ["vllm@float32"], ["hyprefix", "hyprefix"], [], ["transformers@kv-int8"],
                ["hyprefix@kv-int4"], ["hyprefix@bfloat16+float32"], ["hyprefix@kv-int8+kv-fp8_e4m3"]):
        with pytest.raises(ValueError, match="arms must be"):
            check_arm_names(bad, ["hyprefix", "transformers"])
    # a hyprefix arm's --kv-cache-dtype rides in its suffix, beside or without a dtype
    check_arm_names(["hyprefix@bfloat16", "hyprefix@bfloat16+kv-int8", "hyprefix@kv-fp8_e4m3"], ["hyprefix"])
    assert split_arm("hyprefix@bfloat16+kv-int8") == ("hyprefix", "bfloat16")
    assert (arm_kv_cache_dtype("hyprefix@bfloat16+kv-int8"), arm_kv_cache_dtype("hyprefix@kv-fp8_e4m3"),
            arm_kv_cache_dtype("hyprefix@bfloat16")) == ("int8", "fp8_e4m3", None)


def test_bench_kv_pool_holds_the_whole_workload() -> None:
    w = SharedPrefixWorkload(groups=2, num_requests=3, system_len=30, suffix_len=4, output_len=3)
    assert workload_kv_blocks(w, block_size=16) == 6 * 3  # 37 tokens -> 3 blocks each
    mt = MultiTurnWorkload(conversations=1, turns=2, system_len=10, message_len=5, output_len=2)
    assert workload_kv_blocks(mt, block_size=4) == 5 + 6  # turns of 15+2 and 22+2 tokens


# ------------------------------------------------------------------- summary maths
def test_percentile() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)
    d = distribution([1.0, None, 3.0])
    assert d["count"] == 2 and d["p50"] == pytest.approx(2.0) and d["mean"] == pytest.approx(2.0)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def _record(tag: str, ttft: float, tokens: int = 3, gap: float = 0.5, prompt_len: int = 10) -> RequestRecord:
    times = [ttft + i * gap for i in range(tokens)]
    return RequestRecord(tag, prompt_len, [5 + i for i in range(tokens)], 0.0, times, times[-1])


def _run(arm: str, seconds: float, ttfts: list[float], computed: int, skipped: int, repeat: int = 0,
         case: str = "rl-burst") -> WorkloadRun:
    stats = {"prefix_cache_queries": computed + skipped, "prefix_cache_hits": skipped,
             "prefix_cache_hit_rate": skipped / (computed + skipped), "prefill_computed_tokens": computed,
             "prefill_skipped_tokens": skipped, "sibling_waits": 0, "num_preemptions": 0}
    return WorkloadRun(arm=arm, case=case, repeat=repeat, round_seconds=[seconds],
                       requests=[_record(f"r{i}", t) for i, t in enumerate(ttfts)], stats=stats)


def test_summary_of_a_request_workload_on_synthetic_timings() -> None:
    w = RlBurstWorkload(num_prompts=1, num_samples=4, prompt_len=10, output_len=3)
    ttfts = [0.1, 0.2, 0.3, 0.4]
    runs = {
        "hyprefix": {"rl-burst": [_run("hyprefix", s, ttfts, 10, 30, r) for r, s in enumerate((2.0, 4.0, 3.0))]},
        "hyprefix-nocache": {"rl-burst": [_run("hyprefix-nocache", 9.0, [1.0] * 4, 40, 0, r) for r in range(3)]},
        COMPARE_ARM: {"rl-burst": [_run(COMPARE_ARM, 1.0, [0.1] * 4, 12, 28, r) for r in range(3)]},
    }
    s = summarise(runs, w, {"hyprefix": "a", "hyprefix-nocache": "a", COMPARE_ARM: "b"})
    h = s["arms"]["hyprefix"]["rl-burst"]
    assert h["total_seconds"] == {"median": 3.0, "min": 2.0, "max": 4.0, "all": [2.0, 4.0, 3.0]}
    assert (h["requests"], h["prompt_tokens"], h["output_tokens"], h["model"]) == (4, 40, 12, "a")
    assert h["requests_per_s"]["median"] == pytest.approx(4 / 3) and h["output_tokens_per_s"]["max"] == 6.0
    assert h["ttft_seconds"]["count"] == 12 and h["ttft_seconds"]["p50"] == pytest.approx(0.25)
    assert h["tpot_seconds"]["p50"] == pytest.approx(0.5) and h["itl_seconds"]["count"] == 24
    # after the last first token (0.4 s): 8 tokens until 1.4 s
    assert h["decode_tokens_per_s"]["median"] == pytest.approx(8.0)
    assert h["computed_vs_ideal"] == pytest.approx(1.0) and h["stats_identical_across_repeats"] is True
    ratios = {r["name"]: r["value"] for r in s["ratios"]}
    assert ratios == pytest.approx({
        "time hyprefix-nocache / hyprefix": 3.0, "TTFT p50 hyprefix-nocache / hyprefix": 4.0,
        "TTFT p90 hyprefix-nocache / hyprefix": 2.5, "TPOT p50 hyprefix-nocache / hyprefix": 1.0,
        "prefill computed / ideal (hyprefix)": 1.0,
        f"prefill computed / ideal ({COMPARE_ARM})": 1.2, "prefix hit rate model / compare-model": 0.75 / 0.7})
    assert s["output_agreement"] == [{"case": "rl-burst", "arms": ["hyprefix", "hyprefix-nocache"], "of": 12,
                                      "identical": 12, "same_first_token": 12, "first_difference_at": {}}]
    assert s["disturbed_runs"] == {"count": 0, "of": 9, "threshold_other_cores": 0.25}


def _throughput_runs(arm: str, prefill: float, decode: dict[int, float]) -> dict[str, list[WorkloadRun]]:
    """One repeat of a throughput arm: ``prefill`` tok/s (1000 tokens) and decode tok/s per batch."""
    seconds = 1000 / prefill
    runs = {"prefill": [WorkloadRun(arm, "prefill", 0, [seconds], [
        RequestRecord("b0", 1000, [1], 0.0, [seconds], seconds)])]}
    for b, tps in decode.items():
        times = [1 + i * b / tps for i in range(11)]  # b sequences, 10 tokens each after the first
        runs[f"decode@{b}"] = [WorkloadRun(arm, f"decode@{b}", 0, [times[-1]], [
            RequestRecord(f"b{i}", 8, [1] * 11, 0.0, times, times[-1]) for i in range(b)])]
    return runs


def test_throughput_ratios_and_flops_on_synthetic_timings() -> None:
    w = ThroughputWorkload(prompt_len=1000, decode_prompt_len=8, decode_tokens=11, batch_sizes=(1, 16))
    runs = {"hyprefix": _throughput_runs("hyprefix", 120.0, {1: 6.0, 16: 48.0}),
            "transformers": _throughput_runs("transformers", 100.0, {1: 5.0, 16: 30.0}),
            "hyprefix@bfloat16": _throughput_runs("hyprefix@bfloat16", 20.0, {1: 9.0, 16: 10.0}),
            "hyprefix@float32": _throughput_runs("hyprefix@float32", 125.0, {1: 6.0, 16: 48.0})}
    facts = SimpleNamespace(matmul_params=100, lm_head_params=10, attention_layers=2, attention_width=8)
    s = summarise(runs, w, {}, facts=facts, peak={"gflops": 0.01})
    assert s["arms"]["transformers"]["decode@16"]["decode_tokens_per_s"]["median"] == pytest.approx(30.0)
    assert [(r["name"], r["denominator"]) for r in s["ratios"]] == [
        ("prefill hyprefix / transformers", "transformers prefill"),
        ("decode hyprefix B=1 / transformers B=1", "transformers decode@1"),
        ("decode hyprefix B=16 / transformers B=16", "transformers decode@16"),
        ("decode hyprefix B=16 / transformers B=1", "transformers decode@1"),
        ("prefill hyprefix / fastest explicit dtype", "hyprefix@float32 prefill")]
    assert [r["value"] for r in s["ratios"]] == pytest.approx([1.2, 1.2, 1.6, 9.6, 120 / 125])
    assert "target" not in str(s["ratios"]) and "pass" not in str(s["ratios"])  # measured values only
    assert s["prefill_flops"] == {"linear": 2e5, "lm_head": 20.0, "attention": 3.2e7, "total": 2e5 + 20 + 3.2e7}
    assert s["prefill_flops"] == prefill_flops(facts, 1000)
    gflops = s["prefill_flops"]["total"] / (1000 / 120) / 1e9
    assert s["prefill_peak"]["hyprefix"] == pytest.approx({"prefill_gflops": gflops, "fraction_of_peak": gflops / 0.01})
    assert [(a["case"], a["arms"], a["identical"], a["of"]) for a in s["output_agreement"]] == [
        ("prefill", ["hyprefix", "transformers"], 1, 1), ("decode@1", ["hyprefix", "transformers"], 1, 1),
        ("decode@16", ["hyprefix", "transformers"], 16, 16)]


def test_batch1_tpot_against_each_arms_own_weight_bytes() -> None:
    """hyprefix and llama.cpp arms get a roofline ratio, each over the bytes its decode step
    reads (llama.cpp's from its GGUF file); transformers gets none."""
    w = ThroughputWorkload(prompt_len=1000, decode_prompt_len=8, decode_tokens=11, batch_sizes=(1,))
    runs = {"hyprefix": _throughput_runs("hyprefix", 120.0, {1: 50.0}),
            "llama.cpp": _throughput_runs("llama.cpp", 100.0, {1: 40.0}),
            "transformers": _throughput_runs("transformers", 100.0, {1: 5.0})}
    facts = SimpleNamespace(matmul_params=100, lm_head_params=10, attention_layers=2, attention_width=8,
                            decode_weight_bytes=10**9, quantization=None)
    bandwidth = {"median_gb_per_s": 40.0, "gb_per_s": 50.0}
    roof = summarise(runs, w, {}, facts=facts, bandwidth=bandwidth, decode_bytes={"llama.cpp": 5 * 10**8})[
        "decode_roofline"]
    assert roof["roofline_seconds"] == pytest.approx(0.025)
    assert set(roof["arms"]) == {"hyprefix", "llama.cpp"}
    assert roof["arms"]["hyprefix"] == pytest.approx(
        {"tpot_seconds": 0.02, "weight_bytes": 10**9, "tpot_over_roofline": 0.8})
    assert roof["arms"]["llama.cpp"] == pytest.approx(
        {"tpot_seconds": 0.025, "weight_bytes": 5 * 10**8, "tpot_over_roofline": 2.0})


def test_batch1_roofline_pairs_each_decode_run_with_its_own_read_rate() -> None:
    """Where each decode run recorded the read rate of its moment, the ratio is the median
    over repeats of TPOT over that moment's roofline; the rate around the arms is kept."""
    w = ThroughputWorkload(prompt_len=1000, decode_prompt_len=8, decode_tokens=11, batch_sizes=(1,))
    runs = {"hyprefix": _throughput_runs("hyprefix", 120.0, {1: 50.0}),
            "llama.cpp": _throughput_runs("llama.cpp", 100.0, {1: 40.0})}
    for name, extra in (("hyprefix", [25.0, 100.0]), ("llama.cpp", [20.0, 50.0])):
        more = _throughput_runs(name, 100.0, {1: extra[0]})["decode@1"] + \
            _throughput_runs(name, 100.0, {1: extra[1]})["decode@1"]
        runs[name]["decode@1"] += more
    rates = {"hyprefix": [40.0, 20.0, 80.0], "llama.cpp": [40.0, 30.0, 30.0]}
    for name, by_case in runs.items():
        for run, rate in zip(by_case["decode@1"], rates[name], strict=True):
            run.read_gb_per_s = rate
    facts = SimpleNamespace(matmul_params=100, lm_head_params=10, attention_layers=2, attention_width=8,
                            decode_weight_bytes=10**9, quantization=None)
    roof = summarise(runs, w, {}, facts=facts, bandwidth={"median_gb_per_s": 60.0, "gb_per_s": 70.0})[
        "decode_roofline"]
    assert roof["read_gb_per_s"] == 40.0 and roof["read_gb_per_s_around_arms"] == 60.0
    assert roof["roofline_seconds"] == pytest.approx(1 / 40)
    # hyprefix: TPOT 20, 40, 10 ms against rooflines 25, 50, 12.5 ms -> 0.8 each
    assert roof["arms"]["hyprefix"]["tpot_over_roofline_per_repeat"] == pytest.approx([0.8, 0.8, 0.8])
    assert roof["arms"]["hyprefix"]["tpot_over_roofline"] == pytest.approx(0.8)
    # llama.cpp: TPOT 25, 50, 20 ms against 25, 33.3, 33.3 ms -> 1.0, 1.5, 0.6: median 1.0
    assert roof["arms"]["llama.cpp"]["tpot_over_roofline"] == pytest.approx(1.0)
    assert roof["arms"]["llama.cpp"]["tpot_seconds"] == pytest.approx(0.025)


def test_run_arms_measures_the_read_rate_before_each_batch1_decode_run(tiny_models) -> None:
    from hyprefix.bench.arms import load_arm, run_arms

    w = ThroughputWorkload(prompt_len=20, decode_prompt_len=8, decode_tokens=3, batch_sizes=(1, 2), vocab_size=512)
    arm = load_arm("hyprefix", str(tiny_models["qwen3"][0]), w, dtype="float32", engine_kwargs={"num_kv_blocks": 64})
    calls = []
    runs, _ = run_arms({"hyprefix": arm}, w, repeats=2, read_rate=lambda: calls.append(1) or 30.0 + len(calls))
    assert [r.read_gb_per_s for r in runs["hyprefix"]["decode@1"]] == [31.0, 32.0]
    assert all(r.read_gb_per_s is None for case in ("prefill", "decode@2") for r in runs["hyprefix"][case])


def test_gguf_decode_bytes_count_the_embedding_only_as_a_tied_head(tmp_path) -> None:
    from hyprefix.bench.arms import _gguf_weight_bytes, load_arm
    from tests.models.test_gguf_errors import TENSORS, write_gguf

    path = write_gguf(tmp_path / "tiny.gguf")
    total, decode, types = _gguf_weight_bytes(str(path))
    sizes = {name: 4 * int(torch.tensor(shape).prod()) for name, shape in TENSORS.items()}
    assert total == sum(sizes.values()) and types == ["F32"]
    assert decode == total - sizes["token_embd.weight"]  # the file has output.weight: the head is its own
    with pytest.raises(ValueError, match=r"the llama\.cpp arm runs GGUF files"):
        load_arm("llama.cpp", "demo-dense-tiny", ThroughputWorkload(), dtype="float32")


def test_flags_of_another_workload_are_refused(capsys) -> None:
    assert main(["bench", "--workload", "shared-prefix", "--turns", "3"]) == 2
    assert "--turns" in capsys.readouterr().err
    assert main(["bench", "--workload", "throughput", "--num-samples", "3"]) == 2
    assert main(["bench", "--workload", "throughput", "--compare-model", "x"]) == 2
    assert "--compare-model" in capsys.readouterr().err
    assert main(["bench", "--workload", "random", "--vocab-size", "100"]) == 2
    assert "need --url" in capsys.readouterr().err
    assert main(["bench", "--workload", "multi-turn", "--arms", "hyprefix-nocache", "--compare-model", "x"]) == 2
    assert main(["bench", "--workload", "rl-burst", "--arms", "hyprefix,vllm"]) == 2
    assert "arms must be" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--workload", "random", "--vocab-size", "5", "--tokenizer", "x"])


def test_missing_bench_extra_says_how_to_install(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"pip install 'hyprefix\[bench\]'"):
        env.require("matplotlib")


# ------------------------------------------------------------------------ end to end
TINY = ["--dtype", "float32", "--repeats", "1", "--enforce-eager", "--arms", "hyprefix,hyprefix-nocache",
        "--kv-cache-memory-gb", "0.02", "--state-cache-memory-gb", "0.01"]
CASES = {
    "shared-prefix": ["--model", "demo-hybrid-tiny", "--num-requests", "4", "--system-len", "48", "--suffix-len", "8",
                      "--output-len", "3"],
    "rl-burst": ["--model", "demo-hybrid-tiny", "--num-prompts", "1", "--num-samples", "4", "--prompt-len", "48",
                 "--output-len", "3"],
    "multi-turn": ["--model", "demo-hybrid-tiny", "--compare-model", "demo-dense-tiny", "--conversations", "2",
                   "--turns", "3", "--system-len", "32", "--message-len", "16", "--output-len", "3"],
    "random": ["--model", "demo-dense-tiny", "--num-requests", "4", "--prompt-len", "24", "--output-len", "3"],
}
# requests and prompt tokens of each case: 4 groups x 4 x (48 + 8); 4 x 48; 2 x (48 + 67 + 86) (each turn
# appends a 3-token answer and a 16-token message); 4 random lengths around 24
EXPECTED = {"shared-prefix": (16, 16 * 56), "rl-burst": (4, 4 * 48), "multi-turn": (6, 2 * (48 + 67 + 86)),
            "random": (4, RandomWorkload(num_requests=4, prompt_len=24, output_len=3).ideal_prefill_tokens())}


@pytest.mark.parametrize("workload", list(CASES))
def test_end_to_end(workload: str, tmp_path: Path, capsys) -> None:
    out = tmp_path / "bench.json"
    plots = ["--plot", str(tmp_path / "plots")] if workload == "multi-turn" else []
    assert main(["--log-level", "WARNING", "bench", "--workload", workload, *CASES[workload], *TINY,
                 "--out", str(out), *plots]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"hyprefix bench --workload {workload}: {CASES[workload][1]} (float32)\n")
    result = json.loads(out.read_text())
    assert result["workload"] == workload and result["cases"] == [workload]
    assert result["workload_config"]["token_range"] == [3, 4096]  # the tiny models' vocabulary
    expected = ["hyprefix", "hyprefix-nocache", *([COMPARE_ARM] if workload == "multi-turn" else [])]
    assert result["arm_order"] == expected and set(result["arms"]) == set(expected)
    total, prompt_tokens = EXPECTED[workload]
    for name in expected:
        arm = result["arms"][name][workload]
        assert (arm["requests"], arm["prompt_tokens"], arm["output_tokens"]) == (total, prompt_tokens, total * 3)
        assert arm["ttft_seconds"]["count"] == total and arm["itl_seconds"]["count"] == total * 2
        stats = arm["stats"]
        assert stats["prefix_cache_queries"] == stats["prefill_computed_tokens"] + stats["prefill_skipped_tokens"] \
            == prompt_tokens
        assert stats["prefix_cache_hit_rate"] == pytest.approx(stats["prefix_cache_hits"] / prompt_tokens)
        assert stats["cache_at_start"] == {"kv_blocks_cached": 0, "mamba_checkpoints_used": 0}
        assert arm["peak_rss_growth_gib"] is not None  # sampled in this process
        assert result["arm_info"][name]["memory_bytes"]["weights"] > 0
    assert "memory: weights + pools (GiB)" in printed and "prefix hit rate" in printed
    cache, nocache = (result["arms"][name][workload]["stats"] for name in ("hyprefix", "hyprefix-nocache"))
    assert nocache["prefill_computed_tokens"] == prompt_tokens and nocache["prefix_cache_hits"] == 0
    agreement = result["output_agreement"][0]
    assert agreement["arms"] == ["hyprefix", "hyprefix-nocache"] and agreement["of"] == total
    if workload != "rl-burst":  # greedy: caching on and off give the same tokens (float32)
        assert agreement["identical"] == total
    # every distinct prefix computed once (rl-burst: a full hit still computes the last prompt token)
    ideal = {"shared-prefix": 4 * (48 + 4 * 8), "rl-burst": 48, "random": prompt_tokens, "multi-turn": None}[workload]
    assert result["arms"]["hyprefix"][workload]["ideal_prefill_tokens"] == ideal
    if ideal is not None:
        assert cache["prefill_computed_tokens"] == ideal + (3 if workload == "rl-burst" else 0)
    if workload == "multi-turn":
        assert cache["prefill_computed_tokens"] < nocache["prefill_computed_tokens"]
        compare = result["arms"][COMPARE_ARM][workload]
        assert compare["model"] == "demo-dense-tiny" and compare["stats"]["prefix_cache_hits"] > 0
        hit = next(r for r in result["ratios"] if r["name"] == "prefix hit rate model / compare-model")
        assert hit["value"] == pytest.approx(cache["prefix_cache_hit_rate"] / compare["stats"]["prefix_cache_hit_rate"])
        assert f"prefix hit rate model / compare-model   {hit['value']:.2f}" in printed
        assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
            "multi-turn-prefill.png", "multi-turn-throughput.png", "multi-turn-ttft.png"]
    assert "PASS" not in printed and "FAIL" not in printed and "target" not in printed


@pytest.mark.slow
def test_throughput_end_to_end(tmp_path: Path, capsys, small_matmul_peak) -> None:
    out = tmp_path / "throughput.json"
    assert main(["--log-level", "WARNING", "bench", "--workload", "throughput", "--model", "demo-dense-tiny",
                 "--repeats", "1", "--prompt-len", "24", "--decode-prompt-len", "8", "--arms",
                 "hyprefix,transformers,hyprefix@float32",
                 "--decode-tokens", "3", "--batch-sizes", "1,2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("hyprefix bench --workload throughput: demo-dense-tiny (auto -> float32)\n")
    assert "prefill hyprefix / transformers" in printed and "PASS" not in printed and "target" not in printed
    result = json.loads(out.read_text())
    peak = result["peak"]
    # the engine prepacks float32 weights on this CPU or not: the peak names that path and measured it
    engine_path = "prepacked" if device_caps("cpu").prepack(torch.float32) else "plain"
    assert peak["dtype"] == "float32" and peak["path"] == engine_path
    assert set(peak["gflops_by_path"]) == {"plain", engine_path}
    assert peak["gflops"] == max(peak["gflops_by_path"].values())
    assert result["environment"]["device_caps"] == device_caps("cpu").to_dict()
    assert {a["dtype"] for a in result["arm_info"].values()} == {"float32"}
    # decode@B compares with transformers generating the B rows as one batch
    assert result["arm_info"]["transformers"]["batching"] == "each round as one batch"
    assert result["cases"] == ["prefill", "decode@1", "decode@2"]
    for arm in result["arms"].values():
        assert [(c, s["requests"], s["output_tokens"]) for c, s in arm.items()] == [
            ("prefill", 1, 1), ("decode@1", 1, 3), ("decode@2", 2, 6)]
    assert [r["name"] for r in result["ratios"]] == [
        "prefill hyprefix / transformers", "decode hyprefix B=1 / transformers B=1",
        "decode hyprefix B=2 / transformers B=2", "decode hyprefix B=2 / transformers B=1",
        "prefill hyprefix / fastest explicit dtype"]
    flops = result["prefill_flops"]
    assert flops == prefill_flops(SimpleNamespace(**result["model_facts"]), 24)
    assert result["prefill_peak"]["hyprefix"]["fraction_of_peak"] == pytest.approx(
        result["prefill_peak"]["hyprefix"]["prefill_gflops"] / peak["gflops"])
    # float32: the engine's greedy tokens are transformers' on the same weights
    assert [(a["case"], a["identical"], a["of"]) for a in result["output_agreement"]] == [
        ("prefill", 1, 1), ("decode@1", 1, 1), ("decode@2", 2, 2)]


@pytest.mark.parametrize("which", ["demo-hybrid-tiny", "mamba2"])
def test_throughput_on_hybrid_and_mamba2_models(which: str, request, tmp_path: Path, capsys,
                                                small_matmul_peak) -> None:
    """KV bytes, state bytes and FLOPs come from the engine's model, whatever its kind (issue 17)."""
    model = str(request.getfixturevalue("hybrid_models")["mamba2"][0]) if which == "mamba2" else which
    out = tmp_path / "throughput.json"
    assert main(["--log-level", "WARNING", "bench", "--workload", "throughput", "--model", model, "--dtype",
                 "float32", "--repeats", "1", "--prompt-len", "24", "--decode-prompt-len", "8", "--decode-tokens",
                 "3", "--batch-sizes", "1,2", "--enforce-eager", "--out", str(out), "--plot", str(tmp_path)]) == 0
    assert (tmp_path / "throughput-throughput.png").is_file()
    assert capsys.readouterr().out.startswith(f"hyprefix bench --workload throughput: {model} (float32)\n")
    result = json.loads(out.read_text())
    assert result["arm_order"] == ["hyprefix", "transformers"] and result["skipped_arms"] == {}
    facts = result["model_facts"]
    assert facts["state_bytes_per_sequence"] > 0
    assert (facts["attention_layers"], facts["kv_bytes_per_token"] > 0) == ((0, False) if which == "mamba2" else
                                                                           (1, True))
    assert result["prefill_flops"] == prefill_flops(SimpleNamespace(**facts), 24)
    assert (result["prefill_flops"]["attention"] == 0) == (which == "mamba2")
    for arm in result["arms"].values():
        assert [(c, s["output_tokens"]) for c, s in arm.items()] == [("prefill", 1), ("decode@1", 3), ("decode@2", 6)]
    assert [(a["case"], a["identical"], a["of"]) for a in result["output_agreement"]] == [
        ("prefill", 1, 1), ("decode@1", 1, 1), ("decode@2", 2, 2)]


def test_a_transformers_arm_that_cannot_run_is_skipped_with_the_reason(monkeypatch, capsys) -> None:
    from hyprefix.bench import arms

    def refuse(self, *args, **kwargs) -> None:
        raise ValueError("this architecture is not supported")

    monkeypatch.setattr(arms.TransformersArm, "__init__", refuse)
    assert main(["--log-level", "ERROR", "bench", "--workload", "random", "--model", "demo-dense-tiny", "--dtype",
                 "float32", "--repeats", "1", "--enforce-eager", "--arms", "hyprefix,transformers", "--num-requests",
                 "2", "--prompt-len", "16", "--output-len", "2"]) == 0
    printed = capsys.readouterr().out
    assert "transformers arm skipped: loading failed: ValueError: this architecture is not supported" in printed
