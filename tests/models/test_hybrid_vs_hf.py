"""NemotronH, Bamba, Mamba2, Qwen3.5 and Qwen3-Next vs transformers on the same tiny float32 weights."""

from __future__ import annotations

import copy

import pytest
import torch

from hyprefix import LLM, SamplingParams
from hyprefix.hardware import device_caps
from hyprefix.models.gated_deltanet import GatedDeltaNet
from hyprefix.models.mamba2 import Mamba2Mixer
from tests.support.compare import hf_greedy, logit_errors, random_prompts
from tests.support.models import HYBRID_ARCHS, TINY_CASCADE

LOGIT_ATOL = 1e-4
# Shorter than the conv kernel (4), around the SSD chunk (16) and the block size, and
# long enough to span several prefill chunks of 32 tokens.
LENGTHS = (1, 2, 3, 16, 23, 57, 130)


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
@pytest.mark.parametrize("chunk", [None, 9])
def test_logits_close(hybrid_models, arch, chunk):
    path, hf = hybrid_models[arch]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=128)
    prompts = random_prompts(LENGTHS, seed=1)
    for p, (err, _) in zip(prompts, logit_errors(llm, hf, prompts, chunk), strict=True):
        assert err < LOGIT_ATOL, f"{arch} prompt len {len(p)}: max |logit diff| {err:.2e}"


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
@pytest.mark.parametrize("block_size", [16, 7])
def test_greedy_matches_hf_generate(hybrid_models, arch, block_size):
    """Engine greedy decoding (chunked prefill; decode attention through cascade segments,
    which tiny prompts take with ``TINY_CASCADE``) equals transformers' generate."""
    path, hf = hybrid_models[arch]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=256, block_size=block_size,
                          max_num_batched_tokens=32, **TINY_CASCADE)
    prompts = random_prompts(LENGTHS, seed=2)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for p, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, p, 10), f"{arch} len {len(p)}"
    llm.check_invariants()
    assert llm.get_stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("arch", ["nemotron_h", "qwen3_5"])
def test_bfloat16_hybrid_close_to_float32_reference(hybrid_models, arch):
    path, hf = hybrid_models[arch]
    llm = LLM(str(path), dtype="bfloat16", num_kv_blocks=128)
    mixers = [m for m in llm.engine.runner.model.modules() if isinstance(m, Mamba2Mixer | GatedDeltaNet)]
    # The recurrent mixers' input projection is prepacked exactly where oneDNN runs bf16 on this CPU.
    assert mixers and all((m.in_proj.forms.packed is not None) is device_caps("cpu").prepack(torch.bfloat16)
                          for m in mixers)
    prompts = random_prompts((5, 40), seed=4)
    # transformers' own bf16 copy of the model, as far from its float32 logits as bf16 puts it
    hf_bf16 = copy.deepcopy(hf).to(torch.bfloat16)
    with torch.no_grad():
        hf_errs = [(hf_bf16(torch.tensor([p])).logits[0, -1].float() - hf(torch.tensor([p])).logits[0, -1]).abs().max()
                   for p in prompts]
    for (err, scale), hf_err in zip(logit_errors(llm, hf, prompts), hf_errs, strict=True):
        assert err < max(0.05 * scale, 2 * hf_err.item()), f"{arch}: {err:.3f} (transformers bf16: {hf_err:.3f})"
