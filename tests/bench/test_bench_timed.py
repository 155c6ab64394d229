"""Timed workloads (agent, starvation) and arm names with engine options: the generators on
plain data, the arm-name grammar, and one real-time run of each workload on the tiny demo model
(structure, ordering of times and cache hits, never durations)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hyprefix.bench.arm_names import arm_config, arm_engine_options, arm_kv_cache_dtype, check_arm_names, split_arm
from hyprefix.bench.timed import AgentWorkload, StarvationWorkload, poisson_arrivals
from hyprefix.bench.workloads import TOKEN_LOW
from hyprefix.cli import main

TINY_AGENT = {"num_sessions": 3, "turns": 3, "system_len": 32, "message_len": 12, "range_ratio": 0.5,
              "tool_pause_s": 0.01, "request_rate": 200.0, "output_len": 3}


# ----------------------------------------------------------------------- generators
def test_agent_sessions_are_seeded_and_grow_by_answer_and_message() -> None:
    w = AgentWorkload(**TINY_AGENT, cache_ttl_s=30.0, seed=3)
    sessions = w.sessions()
    assert sessions == AgentWorkload(**TINY_AGENT, cache_ttl_s=30.0, seed=3).sessions()
    assert sessions != AgentWorkload(**TINY_AGENT, cache_ttl_s=30.0, seed=4).sessions()
    assert [s.start_s for s in sessions] == sorted(s.start_s for s in sessions) and sessions[0].start_s == 0
    system = sessions[0].turns[0].message[:32]
    for i, s in enumerate(sessions):
        assert [t.tag for t in s.turns] == [f"s{i}/t{k}" for k in range(3)] and s.group == i
        assert s.turns[0].message[:32] == system and s.turns[0].pause_s == 0  # the shared system prompt
        assert all(6 <= len(t.message) <= 18 for t in s.turns[1:]) and 6 <= len(s.turns[0].message) - 32 <= 18
        assert all(0.005 <= t.pause_s <= 0.015 for t in s.turns[1:])
        assert [t.cache_ttl_s for t in s.turns] == [30.0, 30.0, 0.0]  # not the last turn: no next one
        assert all(TOKEN_LOW <= x < w.vocab_size for t in s.turns for x in t.message)
    s = sessions[1]
    first = w.request(s, 0)
    second = w.request(s, 1, first, [7, 8, 9])
    assert first.prompt == s.turns[0].message and first.cache_ttl_s == 30.0 and first.tag == "s1/t0"
    assert second.prompt == (*first.prompt, 7, 8, 9, *s.turns[1].message) and second.max_tokens == 3
    assert w.prompt_lens() == [[sum(len(t.message) for t in s.turns) + 2 * 3 for s in sessions]]
    assert w.num_rounds == 3
    assert {t.cache_ttl_s for s in AgentWorkload(**TINY_AGENT).sessions() for t in s.turns} == {0.0}
    with pytest.raises(ValueError, match="turn 1"):
        w.request(s, 1)
    with pytest.raises(TypeError, match="timed"):
        w.round_requests(0)
    for bad in ({"tool_pause_s": -1.0}, {"cache_ttl_s": float("inf")}, {"request_rate": 0.0}, {"turns": 0}):
        with pytest.raises(ValueError):
            AgentWorkload(**{**TINY_AGENT, **bad})


def test_starvation_sessions_tell_hot_from_cold() -> None:
    w = StarvationWorkload(num_requests=5, num_cold_requests=3, system_len=40, suffix_len=4, prompt_len=20,
                           output_len=2)
    sessions = w.sessions()
    hot = [s.turns[0] for s in sessions if s.turns[0].tag.startswith("hot/")]
    cold = [s.turns[0] for s in sessions if s.turns[0].tag.startswith("cold/")]
    assert [t.tag for t in hot] == [f"hot/r{i}" for i in range(5)] and [t.tag for t in cold] == ["cold/r0", "cold/r1",
                                                                                               "cold/r2"]
    assert len({t.message[:40] for t in hot}) == 1 and len({t.message for t in hot}) == 5
    assert all(len(t.message) == 44 for t in hot) and all(len(t.message) == 20 for t in cold)
    assert len({t.message[:8] for t in cold} | {hot[0].message[:8]}) == 4  # cold prompts share nothing
    assert all(len(s.turns) == 1 and s.start_s >= 0 for s in sessions) and w.request_classes == ("hot", "cold")
    assert w.ideal_prefill_tokens() == 40 + 5 * 4 + 3 * 20
    assert w.kv_blocks(16) == 3 + 5 * (1 + 1) + 3 * 2  # the prefix once
    assert w.engine_defaults() == {"max_num_seqs": 4}
    arrivals = poisson_arrivals(__import__("random").Random(1), 10.0, 4)
    assert arrivals[0] == 0 and arrivals == sorted(arrivals) and len(arrivals) == 4


# ----------------------------------------------------------------------- arm names
def test_arm_names_take_engine_options() -> None:
    assert arm_engine_options("hyprefix+scheduling-policy=cache-aware+scheduling-max-wait-s=1000000") == {
        "scheduling_policy": "cache-aware", "scheduling_max_wait_s": 1e6}
    name = "hyprefix@bfloat16+kv-int8+max-retention-s=0+enforce-eager=true"
    assert split_arm(name) == ("hyprefix", "bfloat16") and arm_kv_cache_dtype(name) == "int8"
    assert arm_engine_options(name) == {"max_retention_s": 0.0, "enforce_eager": True}
    assert split_arm("hyprefix+max-num-seqs=4") == ("hyprefix", None) and arm_engine_options("hyprefix") == {}
    check_arm_names(["hyprefix", "hyprefix+max-retention-s=0", "hyprefix-nocache+max-num-seqs=2"],
                    ["hyprefix", "hyprefix-nocache"])
    assert arm_config("hyprefix@bfloat16+max-num-seqs=4") == arm_config("hyprefix+max-num-seqs=4+bfloat16")
    for bad, message in (("hyprefix+bogus-field=1", "not an engine option"),
                         ("hyprefix+max_retention_s=0", "did you mean max-retention-s"),
                         ("hyprefix+max-retention-s=soon", "bad value for max-retention-s"),
                         ("hyprefix+scheduling-policy=lifo", "scheduling_policy must be one of"),
                         ("hyprefix+dtype=float32", "@DTYPE part"),
                         ("transformers+max-num-seqs=2", "only hyprefix arms")):
        with pytest.raises(ValueError, match=message):
            check_arm_names([bad], ["hyprefix", "transformers"])
    with pytest.raises(ValueError, match="same arm spelled twice"):
        check_arm_names(["hyprefix@float32", "hyprefix+float32"], ["hyprefix"])


def test_timed_workload_flags_are_checked(capsys) -> None:
    assert main(["bench", "--workload", "random", "--tool-pause-s", "1"]) == 2
    assert "does not take --tool-pause-s" in capsys.readouterr().err
    assert main(["bench", "--workload", "agent", "--num-cold-requests", "3"]) == 2
    assert main(["bench", "--workload", "starvation", "--arms", "hyprefix,transformers"]) == 2
    assert "transformers arm runs one request at a time" in capsys.readouterr().err
    assert main(["bench", "--workload", "agent", "--url", "http://127.0.0.1:9", "--max-concurrency", "2"]) == 2
    assert "does not take --max-concurrency" in capsys.readouterr().err
    assert main(["bench", "--workload", "agent", "--arms", "hyprefix+no-such-option=1"]) == 2
    assert "not an engine option" in capsys.readouterr().err


# ------------------------------------------------------------------------ end to end
def test_agent_in_real_time_with_retention() -> None:
    """Every turn is submitted at its time, later prompts extend the earlier ones by the
    answer, and the kept prefixes are hit by the next turns."""
    from hyprefix.bench.arms import load_arm, run_workload
    from hyprefix.bench.cli import resolve_model

    w = AgentWorkload(**TINY_AGENT, cache_ttl_s=30.0)
    arm = load_arm("hyprefix+max-num-seqs=8", resolve_model("demo-dense-tiny")[0], w, dtype="float32",
                   engine_kwargs={"enforce_eager": True})
    assert arm.llm.engine.args.max_num_seqs == 8  # the arm's own option
    prompts: dict[str, list[int]] = {}
    add = arm.llm.engine.add_requests

    def spy(requests, *args, **kwargs):
        prompts.update({rid: list(prompt) for rid, prompt, _ in requests})
        return add(requests, *args, **kwargs)

    arm.llm.engine.add_requests = spy
    run = run_workload(arm, w, "agent", repeat=0)
    records = {rec.tag: rec for rec in run.requests}
    assert len(run.requests) == 9 and len(prompts) == 9 and set(records) == {f"s{s}/t{k}" for s in range(3)
                                                                          for k in range(3)}
    sessions = w.sessions()

    def submitted(s: int, k: int) -> list[int]:  # the prompt the engine got for turn k of session s
        message = list(sessions[s].turns[k].message)
        return next(p for p in prompts.values() if p[-len(message):] == message)

    for s in range(3):
        for k in (1, 2):
            before, now = records[f"s{s}/t{k - 1}"], records[f"s{s}/t{k}"]
            assert submitted(s, k) == submitted(s, k - 1) + before.output_ids + list(sessions[s].turns[k].message)
            assert now.sent >= before.end  # after the previous turn and its pause
            assert now.cached_tokens > 0 and before.retained_tokens > 0  # the kept prefix of the turn before
        assert records[f"s{s}/t2"].retained_tokens is None  # the last turn asks nothing
    assert all(rec.sent <= rec.token_times[0] <= rec.end and len(rec.output_ids) == 3 for rec in run.requests)
    assert run.stats["prefix_cache_hits"] > 0 and run.round_seconds[0] > 0


def test_starvation_end_to_end_reports_hot_and_cold(tmp_path: Path, capsys) -> None:
    out = tmp_path / "starvation.json"
    assert main(["--log-level", "WARNING", "bench", "--workload", "starvation", "--model", "demo-dense-tiny",
                 "--dtype", "float32", "--repeats", "1", "--enforce-eager", "--arms",
                 "hyprefix+scheduling-policy=fcfs,hyprefix+scheduling-policy=cache-aware", "--num-requests", "4",
                 "--num-cold-requests", "2", "--system-len", "48", "--suffix-len", "4", "--prompt-len", "16",
                 "--output-len", "2", "--request-rate", "400", "--cold-request-rate", "400", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "longest wait: max TTFT (s)" in printed and "hot: TTFT p50 / p99 / max (s)" in printed
    assert "cold: output tok/s" in printed
    result = json.loads(out.read_text())
    for name in ("hyprefix+scheduling-policy=fcfs", "hyprefix+scheduling-policy=cache-aware"):
        arm = result["arms"][name]["starvation"]
        assert arm["requests"] == 6 and arm["longest_wait_seconds"] == arm["ttft_seconds"]["max"]
        assert {c: (b["requests"], b["output_tokens"], b["ttft_seconds"]["count"]) for c, b in arm["by_class"].items()
                } == {"hot": (4, 8, 4), "cold": (2, 4, 2)}
        assert arm["by_class"]["hot"]["output_tokens_per_s"]["median"] > 0
        assert arm["stats"]["prefix_cache_hits"] >= 3 * 48  # hot requests after the first hit the prefix
        assert result["arm_info"][name]["max_num_seqs"] == 4  # the workload's default
        for rec in result["runs"][name]["starvation"][0]["requests"]:
            assert rec["ttft"] >= 0 and rec["tag"].split("/")[0] in ("hot", "cold")
    assert result["arm_info"]["hyprefix+scheduling-policy=cache-aware"]["scheduling_policy"] == "cache-aware"
