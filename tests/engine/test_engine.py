"""Engine behaviour on a tiny random-weight Qwen3 (float32): chunking and batching
equivalence, n > 1, stop conditions, seeded sampling, chat, metrics and abort."""

from __future__ import annotations

import json
import shutil

import pytest

from hyprefix import LLM, SamplingParams
from tests.support.compare import random_prompts
from tests.support.models import TINY_CASCADE

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = random_prompts((3, 9, 16, 31, 47), seed=11)
EOS = 2  # <|im_end|> in the tiny checkpoints


def make_llm(path, **kw) -> LLM:
    args = dict(dtype="float32", num_kv_blocks=256, block_size=16, log_stats_interval=0, **TINY_CASCADE)
    args.update(kw)
    return LLM(str(path), **args)


def toks(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def gen(llm: LLM, prompts, params) -> list:
    return llm.generate(prompts, params, use_tqdm=False)


@pytest.fixture(scope="module")
def llm(qwen3_dir) -> LLM:
    return make_llm(qwen3_dir)


@pytest.fixture(scope="module")
def reference(llm) -> list[list[int]]:
    """Greedy tokens of every prompt run alone, prompt in one chunk."""
    return [toks(gen(llm, [p], GREEDY))[0] for p in PROMPTS]


@pytest.fixture(scope="module")
def long_greedy(llm):
    """Unconstrained greedy runs (EOS honoured) to take stop strings / tokens from."""
    params = SamplingParams(temperature=0, max_tokens=24)
    return [(p, out.outputs[0]) for p, out in zip(PROMPTS, gen(llm, PROMPTS, params), strict=True)]


# ------------------------------------------------------------------ equivalence
def test_batch_of_one_equals_batch_of_many(llm, reference):
    outs = gen(llm, PROMPTS, GREEDY)
    assert toks(outs) == reference
    for out, p in zip(outs, PROMPTS, strict=True):
        assert out.prompt_token_ids == p
        assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == MAX_TOKENS
    llm.check_invariants()
    assert llm.get_stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize(("budget", "block_size"), [(8, 16), (31, 5), (2048, 16)])
def test_chunked_prefill_equals_unchunked(qwen3_dir, reference, budget, block_size):
    llm = make_llm(qwen3_dir, max_num_batched_tokens=budget, block_size=block_size)
    assert toks(gen(llm, PROMPTS, GREEDY)) == reference
    llm.check_invariants()
    assert llm.get_stats()["kv_blocks_used"] == 0


def test_greedy_is_independent_of_max_num_seqs(qwen3_dir, reference):
    llm = make_llm(qwen3_dir, max_num_seqs=2, max_num_batched_tokens=20)
    assert toks(gen(llm, PROMPTS, GREEDY)) == reference


# ------------------------------------------------------------------------ n > 1
def test_n2_seeded_samples_equal_single_runs(llm):
    p = PROMPTS[1]
    params = SamplingParams(temperature=0.9, seed=7, n=2, max_tokens=10, ignore_eos=True)
    (out,) = gen(llm, [p], params)
    assert out.finished and [c.index for c in out.outputs] == [0, 1]
    assert all(len(c.token_ids) == 10 and c.finish_reason == "length" for c in out.outputs)
    for i, c in enumerate(out.outputs):
        single = SamplingParams(temperature=0.9, seed=7 + i, max_tokens=10, ignore_eos=True)
        alone = gen(llm, [p], single)[0].outputs[0]
        assert (c.token_ids, c.text) == (alone.token_ids, alone.text)
    assert out.outputs[0].token_ids != out.outputs[1].token_ids


def test_n2_greedy_and_unseeded(llm, reference):
    outs = gen(llm, PROMPTS[:2], SamplingParams(temperature=0, n=2, max_tokens=MAX_TOKENS, ignore_eos=True))
    for out, ref in zip(outs, reference[:2], strict=True):
        assert [c.token_ids for c in out.outputs] == [ref, ref]
    outs = gen(llm, PROMPTS[:2], SamplingParams(temperature=1.0, n=2, max_tokens=5, ignore_eos=True))
    assert all(len(out.outputs) == 2 and all(len(c.token_ids) == 5 for c in out.outputs) for out in outs)
    assert llm.get_stats()["kv_blocks_used"] == 0


# ---------------------------------------------------------------- stop conditions
def _pick_stop_string(text: str) -> str:
    """A 3-character piece from the middle of ``text`` that is plain text."""
    for start in range(len(text) // 3, len(text) - 3):
        piece = text[start:start + 3]
        if "\ufffd" not in piece and piece.strip():
            return piece
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_string(llm, long_greedy):
    p, full = next((p, c) for p, c in long_greedy if len(c.text) >= 20)
    stop = _pick_stop_string(full.text)
    (out,) = gen(llm, [p], SamplingParams(temperature=0, max_tokens=24, stop=stop))
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == full.text[:full.text.index(stop)]
    assert stop not in c.text
    k = len(c.token_ids)
    assert 1 <= k < len(full.token_ids) and c.token_ids == full.token_ids[:k]
    # it stopped at the first token that completed the stop string
    if k > 1:
        (shorter,) = gen(llm, [p], SamplingParams(temperature=0, max_tokens=k - 1))
        assert stop not in shorter.outputs[0].text
    assert llm.get_stats()["kv_blocks_used"] == 0


def test_earliest_of_several_stop_strings_wins(llm, long_greedy):
    p, full = next((p, c) for p, c in long_greedy if len(c.text) >= 20)
    text = full.text
    late = _pick_stop_string(text[len(text) // 2:])
    early = next(text[i:i + 4] for i in range(2, len(text) - 4)
                 if "\ufffd" not in text[i:i + 4] and text[i:i + 4].strip() and text.index(text[i:i + 4]) == i)
    assert text.index(early) < text.index(late)
    (out,) = gen(llm, [p], SamplingParams(temperature=0, max_tokens=24, stop=[late, early]))
    c = out.outputs[0]
    assert (c.finish_reason, c.stop_reason) == ("stop", early)
    assert c.text == text[:text.index(early)]


def test_stop_string_never_streams_text_that_is_cut(llm, long_greedy):
    p, full = next((p, c) for p, c in long_greedy if len(c.text) >= 20)
    stop = _pick_stop_string(full.text)
    engine = llm.engine
    engine.add_request("stream-stop", p, SamplingParams(temperature=0, max_tokens=24, stop=[stop, "zzzzzzzz"]))
    texts = []
    for _ in range(200):
        for out in engine.step():
            texts.append(out.outputs[0].text)
            final = out
        if not engine.has_unfinished():
            break
    assert final.finished and final.outputs[0].stop_reason == stop
    for t in texts:
        assert final.outputs[0].text.startswith(t), (t, final.outputs[0].text)
    assert engine.get_stats()["kv_blocks_used"] == 0


def test_stop_token_ids(llm, long_greedy):
    p, full = next((p, c) for p, c in long_greedy if len(c.token_ids) >= 8)
    g = full.token_ids
    k = next(i for i in range(3, len(g)) if g[i] not in g[:i])
    (out,) = gen(llm, [p], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[4095, g[k]]))
    c = out.outputs[0]
    assert c.token_ids == g[:k + 1]
    assert (c.finish_reason, c.stop_reason) == ("stop", g[k])
    # the stop token is reported in token_ids but, as in vLLM, not in the text
    (before,) = gen(llm, [p], SamplingParams(temperature=0, max_tokens=k, ignore_eos=True))
    assert c.text == before.outputs[0].text


def test_max_tokens_gives_length(llm):
    for m in (1, 2, 7):
        (out,) = gen(llm, [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
        c = out.outputs[0]
        assert len(c.token_ids) == m and c.finish_reason == "length" and c.stop_reason is None


def test_eos_and_ignore_eos(qwen3_dir, reference, tmp_path):
    """Make the k-th greedy token an EOS of a copy of the checkpoint."""
    g = reference[3]
    k = next(i for i in range(2, len(g)) if g[i] not in g[:i])
    path = tmp_path / "eos-model"
    shutil.copytree(qwen3_dir, path)
    for name in ("config.json", "generation_config.json"):
        f = path / name
        if f.exists():
            cfg = json.loads(f.read_text())
            cfg["eos_token_id"] = [EOS, g[k]]
            f.write_text(json.dumps(cfg))
    llm = make_llm(path)
    p = PROMPTS[3]
    (out,) = gen(llm, [p], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    c = out.outputs[0]
    assert c.token_ids == g[:k + 1]
    assert (c.finish_reason, c.stop_reason) == ("stop", None)
    (out,) = gen(llm, [p], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert out.outputs[0].token_ids == g and out.outputs[0].finish_reason == "length"
    # stop_token_ids still apply with ignore_eos
    (out,) = gen(llm, [p], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                          stop_token_ids=[g[k]]))
    assert out.outputs[0].token_ids == g[:k + 1] and out.outputs[0].stop_reason == g[k]
    llm.check_invariants()


# ------------------------------------------------------------------- sampling
def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    p = PROMPTS[2]
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    alone = toks(gen(llm, [p], seeded))[0]
    assert toks(gen(llm, [p], seeded))[0] == alone
    others = [SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.7, top_p=0.9, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=1.3, top_k=50, seed=99, max_tokens=20, ignore_eos=True)]
    batch = [PROMPTS[0], p, PROMPTS[4], PROMPTS[1]]
    outs = gen(llm, batch, [others[0], seeded, others[1], others[2]])
    assert outs[1].outputs[0].token_ids == alone
    # and with chunked prefill in a small budget
    small = make_llm(llm.engine.args.model, max_num_batched_tokens=8, block_size=4, seed=5)
    assert toks(gen(small, batch, [others[0], seeded, others[1], others[2]]))[1] == alone
    other_seed = SamplingParams(temperature=1.0, seed=1235, max_tokens=16, ignore_eos=True)
    assert toks(gen(llm, [p], other_seed))[0] != alone


def test_top_k_1_and_tiny_top_p_equal_greedy(llm, reference):
    for params in (SamplingParams(temperature=1.0, top_k=1, max_tokens=MAX_TOKENS, ignore_eos=True),
                   SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=MAX_TOKENS, ignore_eos=True)):
        assert toks(gen(llm, PROMPTS, params)) == reference


# -------------------------------------------------------------------------- chat
def test_chat(llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a prefix cache?"}]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    (out,) = llm.chat(messages, params, use_tqdm=False)
    ids = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert out.prompt_token_ids == list(ids) == llm.encode_chat(messages)
    text = llm.tokenizer.decode(out.prompt_token_ids)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert text.endswith("<|im_start|>assistant\n")
    assert len(out.outputs[0].token_ids) == 8 and out.finished
    assert out.outputs[0].token_ids == toks(gen(llm, [out.prompt_token_ids], params))[0]
    outs = llm.chat([messages, messages[1:]], params, use_tqdm=False)
    assert len(outs) == 2 and outs[0].outputs[0].token_ids == out.outputs[0].token_ids
    with pytest.raises(ValueError):
        llm.chat([[]], params, use_tqdm=False)  # one empty conversation
    assert not llm.engine.has_unfinished()


# ----------------------------------------------------------------------- metrics
def test_metrics_timestamps_are_ordered(qwen3_dir):
    llm = make_llm(qwen3_dir, max_num_batched_tokens=16)
    outs = gen(llm, PROMPTS, [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (1, 3, 5, 2, 4)])
    for out in outs:
        m = out.metrics
        assert None not in (m.arrival_time, m.first_scheduled_time, m.first_token_time, m.finished_time)
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert m.ttft is not None and m.ttft >= 0


# ------------------------------------------------------------------------- abort
def test_abort_mid_flight(llm):
    engine = llm.engine
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    engine.add_request("run", PROMPTS[4], long)
    engine.add_request("pair", PROMPTS[3], SamplingParams(temperature=1.0, n=2, max_tokens=100, ignore_eos=True))
    seen: dict[str, list] = {"run": [], "pair": []}
    for _ in range(4):
        for out in engine.step():
            seen[out.request_id].append(out)
        engine.check_invariants()
    assert engine.get_stats()["kv_blocks_used"] > 0
    generated = len(seen["run"][-1].outputs[0].token_ids)
    assert 0 < generated < 100 and not seen["run"][-1].finished
    assert engine.abort("run") is True
    assert engine.abort("run") is False
    assert engine.abort("never-added") is False
    engine.check_invariants()
    outs = engine.step()
    engine.check_invariants()
    (run,) = [o for o in outs if o.request_id == "run"]
    assert run.finished and run.outputs[0].finish_reason == "abort"
    assert run.outputs[0].token_ids == seen["run"][-1].outputs[0].token_ids
    assert engine.abort("pair") is True
    engine.check_invariants()
    pair = [o for o in engine.step() if o.request_id == "pair"]
    assert len(pair) == 1 and pair[0].finished
    assert [c.finish_reason for c in pair[0].outputs] == ["abort", "abort"]
    assert not engine.has_unfinished()
    stats = engine.get_stats()
    assert stats["kv_blocks_used"] == 0
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0
    # the ids are free again
    engine.add_request("run", PROMPTS[0], SamplingParams(temperature=0, max_tokens=1))
    for _ in range(10):
        engine.step()
        if not engine.has_unfinished():
            break
    assert not engine.has_unfinished() and engine.get_stats()["kv_blocks_used"] == 0


def test_abort_waiting_request(qwen3_dir):
    llm = make_llm(qwen3_dir, max_num_seqs=1)
    engine = llm.engine
    engine.add_request("a", PROMPTS[1], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.add_request("b", PROMPTS[2], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.step()
    stats = engine.get_stats()
    assert (stats["num_requests_running"], stats["num_requests_waiting"]) == (1, 1)
    assert engine.abort("b")
    outs = engine.step()
    (b,) = [o for o in outs if o.request_id == "b"]
    assert b.finished and b.outputs[0].finish_reason == "abort" and b.outputs[0].token_ids == []
    assert b.metrics.first_token_time is None
    assert engine.abort("a")
    engine.step()
    engine.check_invariants()
    assert not engine.has_unfinished() and engine.get_stats()["kv_blocks_used"] == 0


@pytest.mark.batched_graphs
@pytest.mark.parametrize("arch", ["qwen3", "nemotron_h"])
def test_warmup_compiles_ahead_and_changes_nothing(tiny_models, hybrid_models, arch):
    """The server's warm-up step compiles the large-step kernels before any request; it
    leaves no trace in the cache, the stats or the outputs."""
    path = {**tiny_models, **hybrid_models}[arch][0]
    cold = make_llm(path, enforce_eager=True)
    expected = toks(gen(cold, PROMPTS, GREEDY))
    llm = make_llm(path)
    assert not llm.engine.runner.kernels._compiled
    llm.engine.warmup()
    compiled = set(llm.engine.runner.kernels._compiled)
    assert "rms_norm" in compiled
    stats = llm.get_stats()
    assert stats["prefill_computed_tokens"] == stats["kv_blocks_used"] == stats["kv_blocks_cached"] == 0
    assert toks(gen(llm, PROMPTS, GREEDY)) == expected  # with steps of 47 tokens: no new kernel
    assert set(llm.engine.runner.kernels._compiled) == compiled
    llm.check_invariants()
    assert not make_llm(path, enforce_eager=True).engine.runner.warmup()  # nothing to compile
    if arch == "qwen3":  # and the compiled decode steps, batch 1 and batched: the warm-up's two rows
        # share no blocks, so even a cascade threshold below their length plans no shared prefix
        served = make_llm(path, cascade_min_saved_tokens=16, cascade_min_solo_run_tokens=16)
        served.engine.warmup()
        assert served.engine.runner.decode_graphs.compiled_sizes == {1, 2}
        stats = served.get_stats()
        assert stats["prefill_computed_tokens"] == stats["kv_blocks_used"] == stats["kv_blocks_cached"] == 0


def test_the_startup_heap_is_frozen_out_of_the_collector(qwen3_dir):
    """After start-up the cyclic collector no longer walks the engine's objects (a full
    collection of a GGUF Llama's ~370k took ~150 ms, a pause inside some decode step)."""
    import gc

    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    llm = make_llm(qwen3_dir)
    frozen = gc.get_freeze_count()
    assert frozen > 1000
    assert len(gc.get_objects()) < frozen
    assert toks(gen(llm, PROMPTS[:1], GREEDY))[0]
