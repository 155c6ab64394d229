"""``mamba_ssm_cache_dtype="bfloat16"``: the recurrent matrix states (Mamba2, Gated DeltaNet)
live and checkpointed in bfloat16, half the bytes, computed in float32 between stores. A
float32 model's outputs stay close to its float32-state outputs (the first token equal: a
prompt's single prefill chunk reads no stored state), on the fused decode kernel and on the
eager decode path, and prefix hits resume from bfloat16 checkpoints."""

from __future__ import annotations

import math

import pytest
import torch

from hyprefix import LLM, SamplingParams
from hyprefix.kernels import recurrent_decode
from tests.support.compare import random_prompts

ARCHS = ("nemotron_h", "qwen3_5")
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
LOGPROB_ATOL = 0.01  # bf16 keeps 8 bits of mantissa: each stored state rounds by up to ~4e-3, relative


def _engine(path, state_dtype: str) -> LLM:
    return LLM(str(path), dtype="float32", num_kv_blocks=128, mamba_ssm_cache_dtype=state_dtype,
               log_stats_interval=0)


def _steps(out) -> list[dict[int, float]]:
    return [{t: lp.logprob for t, lp in step.items()} for step in out.outputs[0].logprobs]


def _assert_close(ref, got, what: str) -> None:
    """Per step, the top-5 logprobs they share agree, up to the first step whose greedy
    token differs (a near-tie the rounding may flip; none at the first token)."""
    assert ref.outputs[0].token_ids[0] == got.outputs[0].token_ids[0], what
    compared = 0
    for i, (a, b) in enumerate(zip(_steps(ref), _steps(got), strict=True)):
        for token in a.keys() & b.keys():
            assert math.isclose(a[token], b[token], abs_tol=LOGPROB_ATOL), (what, i, token, a[token], b[token])
        compared += 1
        if ref.outputs[0].token_ids[i] != got.outputs[0].token_ids[i]:
            break
    assert compared >= 2, what


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fused", [True, False], ids=["fused-decode", "eager-decode"])
def test_bfloat16_states_close_to_float32_states(hybrid_models, arch, fused, monkeypatch):
    path, _ = hybrid_models[arch]
    if not fused:
        monkeypatch.setattr(recurrent_decode, "runs", lambda proj, matrix: False)
    elif not recurrent_decode.available():
        pytest.skip("the fused recurrent decode kernel does not build here")
    ref, low = _engine(path, "auto"), _engine(path, "bfloat16")
    states = low.engine.runner.recurrent_states
    assert states and all(s.matrix.dtype == s.ckpt_matrix.dtype == torch.bfloat16 for s in states)
    assert all(s.matrix.dtype == torch.float32 for s in ref.engine.runner.recurrent_states)
    matrix_bytes = sum(s.matrix[0].numel() for s in states) * 2  # bf16: half of float32's
    assert ref.engine.state_bytes_per_slot - low.engine.state_bytes_per_slot == matrix_bytes

    prompts = random_prompts((7, 40, 90), seed=11)
    for prompt, a, b in zip(prompts, ref.generate(prompts, PARAMS, use_tqdm=False),
                            low.generate(prompts, PARAMS, use_tqdm=False), strict=True):
        _assert_close(a, b, f"{arch} len {len(prompt)}")
    low.check_invariants()


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_hit_resumes_from_a_bfloat16_checkpoint(hybrid_models, arch):
    path, _ = hybrid_models[arch]
    llm = _engine(path, "bfloat16")
    prompt = random_prompts((100,), seed=12)[0]
    first = llm.generate([prompt], PARAMS, use_tqdm=False)[0]
    again = llm.generate([prompt], PARAMS, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 96  # the last full block's checkpoint
    _assert_close(first, again, f"{arch} hit")
    llm.check_invariants()


def test_bad_state_dtype_is_refused():
    with pytest.raises(ValueError, match="mamba_ssm_cache_dtype"):
        LLM("demo-hybrid-tiny", mamba_ssm_cache_dtype="int8")
