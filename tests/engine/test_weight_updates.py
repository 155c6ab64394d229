"""Weight updates in place (``LLM.update_weights``): the new weights' greedy tokens equal
transformers' on them, whatever form the weights run in (float32, int8, bf16 with the
compiled decode step), hybrids included; a prefix cached under the old weights is never hit
again; a checkpoint that does not fit is refused with the model left as it was."""

from __future__ import annotations

import pytest
import torch

from hyprefix import LLM, SamplingParams
from hyprefix.errors import RequestError
from tests.support.compare import hf_greedy, random_prompts
from tests.support.models import build_tiny_model

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = random_prompts((21, 40), seed=5)


def make_llm(path, **kw) -> LLM:
    return LLM(str(path), **{"dtype": "float32", "num_kv_blocks": 128, "log_stats_interval": 0, **kw})


def tokens(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def new_qwen3(tmp_path_factory):
    """Other random weights of the tiny Qwen3's architecture: (checkpoint dir, HF model)."""
    path = tmp_path_factory.mktemp("qwen3-v2") / "qwen3"
    return path, build_tiny_model("qwen3", path, seed=1)


def test_update_from_a_checkpoint_follows_the_new_weights_and_never_hits_old_blocks(tiny_models, new_qwen3):
    old_path, old_hf = tiny_models["qwen3"]
    new_path, new_hf = new_qwen3
    llm = make_llm(old_path)
    assert tokens(llm) == [hf_greedy(old_hf, p, MAX_TOKENS) for p in PROMPTS]
    assert llm.weight_version == "default"
    result = llm.update_weights(str(new_path), weight_version="step-1")
    assert result["weight_version"] == llm.weight_version == "step-1"
    assert result["num_parameters"] == len(list(llm.engine.runner.model.parameters()))  # every one
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0, 0]  # both prompts were cached under the old weights
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_greedy(new_hf, p, MAX_TOKENS) for p in PROMPTS]
    again = llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0  # blocks of the new weights are hit as usual
    llm.update_weights(new_hf.state_dict().items())  # the same weights again, from a state dict
    assert llm.weight_version == "2"  # no version given: the update's number
    assert llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0
    llm.check_invariants()


def test_update_from_a_state_dict_in_int8_and_a_hybrid(tiny_models, new_qwen3, hybrid_models, tmp_path):
    old_path, _ = tiny_models["qwen3"]
    new_path, new_hf = new_qwen3
    llm = make_llm(old_path, quantization="int8")
    tokens(llm)
    llm.update_weights(new_hf.state_dict().items(), weight_version="v2")
    assert tokens(llm) == tokens(make_llm(new_path, quantization="int8"))  # as if loaded so

    path, _ = hybrid_models["qwen3_5"]
    other = build_tiny_model("qwen3_5", tmp_path / "qwen3_5", seed=3)
    llm = make_llm(path)
    first = tokens(llm)
    llm.update_weights(other.state_dict().items())
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0, 0]  # no KV block nor state checkpoint of the old weights
    updated = [list(o.outputs[0].token_ids) for o in outs]
    assert updated == tokens(make_llm(tmp_path / "qwen3_5"))
    assert updated != first
    llm.check_invariants()


def test_bf16_compiled_decode_reads_the_new_weights(tiny_models, new_qwen3):
    """The compiled batch-1 decode step holds the weight tensors themselves: the update writes
    into them, so it reads the new ones without compiling again."""
    old_path, _ = tiny_models["qwen3"]
    new_path, new_hf = new_qwen3
    llm = make_llm(old_path, dtype="bfloat16", enforce_eager=False)
    tokens(llm, PROMPTS[:1])
    assert llm.get_stats()["decode_steps_graph"] > 0
    llm.update_weights(new_hf.state_dict().items())
    assert tokens(llm, PROMPTS[:1]) == tokens(make_llm(new_path, dtype="bfloat16", enforce_eager=False), PROMPTS[:1])


def test_weights_that_do_not_fit_are_refused_and_change_nothing(tiny_models, new_qwen3):
    old_path, old_hf = tiny_models["qwen3"]
    llm = make_llm(old_path)
    before = tokens(llm)
    state = dict(new_qwen3[1].state_dict())
    name = "model.layers.0.mlp.down_proj.weight"
    cases = {
        "a wrong shape": {**state, name: torch.zeros(3, 3)},
        "a missing weight": {k: v for k, v in state.items() if k != name},
    }
    for case, weights in cases.items():
        with pytest.raises(RequestError, match="do not fit") as info:
            llm.update_weights(weights.items())
        assert info.value.param == "model_path", case
    with pytest.raises(RequestError, match="another architecture"):
        llm.update_weights(str(tiny_models["llama"][0]))
    with pytest.raises(RequestError, match="no checkpoint"):
        llm.update_weights("/nonexistent/checkpoint")
    assert llm.weight_version == "default"
    assert tokens(llm) == before == [hf_greedy(old_hf, p, MAX_TOKENS) for p in PROMPTS]


@pytest.mark.slow  # a subprocess loading transformers and the engine
def test_the_rl_rollout_example_runs_and_finds_no_old_block(tmp_path):
    """``examples/rl_rollout.py`` end to end, small: rollouts with logprobs, a trainer step,
    save, update; it exits non-zero if a prompt of the last step hits a block after an update."""
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "rl_rollout.py"
    out = subprocess.run([sys.executable, str(example), "--steps", "2", "--prompts", "2", "--n", "2",
                          "--system-len", "32", "--question-len", "8", "--max-tokens", "4",
                          "--save-dir", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "step 1:" in out.stdout and "old-version tokens hit 0" in out.stdout
    assert "no block of an old weight version was hit" in out.stdout
