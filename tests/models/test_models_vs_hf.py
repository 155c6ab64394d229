"""Our Llama/Qwen2/Qwen3/Mistral forward vs transformers on the same tiny float32 weights."""

from __future__ import annotations

import pytest
import torch

from hyprefix import LLM, SamplingParams
from hyprefix.hardware import device_caps
from tests.support.compare import hf_greedy, logit_errors, random_prompts
from tests.support.models import ARCHS, TINY_CASCADE

# float32 logits agree to within this absolute tolerance (observed max error ~1e-6).
LOGIT_ATOL = 1e-4
LENGTHS = (3, 16, 23, 57, 130)  # below, at and across block sizes 7/16 and chunk size 32
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("chunk", [None, 9])
def test_logits_close(tiny_models, arch, chunk):
    path, hf = tiny_models[arch]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=128, block_size=16)
    assert_packed_as_the_cpu_allows(llm.engine.runner.model, torch.float32)
    prompts = random_prompts(LENGTHS, seed=1)
    for p, (err, _) in zip(prompts, logit_errors(llm, hf, prompts, chunk), strict=True):
        assert err < LOGIT_ATOL, f"{arch} prompt len {len(p)}: max |logit diff| {err:.2e}"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("block_size", [16, 7])
def test_greedy_matches_hf_generate(tiny_models, arch, block_size):
    """Engine greedy decoding (chunked prefill; decode attention through cascade segments,
    which tiny prompts take with ``TINY_CASCADE``) equals transformers' generate."""
    path, hf = tiny_models[arch]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=256, block_size=block_size,
              max_num_batched_tokens=32, **TINY_CASCADE)  # prompts of 57 and 130 tokens span several chunks
    prompts = random_prompts(LENGTHS, seed=2)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for p, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, p, GREEDY.max_tokens), f"{arch} len {len(p)}"
        assert out.outputs[0].finish_reason == "length"
    llm.check_invariants()


@pytest.mark.parametrize("arch", ["qwen3", "mistral"])
def test_eager_path_logits_close(tiny_models, arch):
    """The same forward with the torch.compile'd elementwise kernels turned off."""
    path, hf = tiny_models[arch]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=128, enforce_eager=True)
    prompts = random_prompts(LENGTHS, seed=3)
    assert all(err < LOGIT_ATOL for err, _ in logit_errors(llm, hf, prompts))


def assert_packed_as_the_cpu_allows(model, dtype: torch.dtype) -> None:
    """Every linear is prepacked exactly when ``device_caps`` says this CPU runs that
    dtype in oneDNN (bf16 needs AVX-512 or AVX-NE-CONVERT; float32 needs oneDNN)."""
    expected = device_caps("cpu").prepack(dtype)
    layer = model.layers[0]
    assert (layer.mlp.gate_up.forms.packed_halves is not None) is expected
    assert (layer.attn.qkv.forms.packed is not None) is expected
    assert (layer.attn.o_proj.forms.packed is not None) is expected
    assert (model.head_forms.packed is not None) is expected


def test_an_mlp_prepacks_gate_up_once(tiny_models):
    """With compiled decode steps a float32 MLP keeps its plain gate/up weight for the graph
    beside its own prepacked gate and up; the gate_up linear itself packs no third copy."""
    path, _ = tiny_models["qwen3"]
    model = LLM(str(path), dtype="float32", num_kv_blocks=64).engine.runner.model
    mlp = model.layers[0].mlp
    assert mlp.gate_up.weight.numel() and mlp.gate_up.forms.packed is None
    assert (mlp.gate_up.forms.packed_halves is not None) is device_caps("cpu").prepack(torch.float32)


@pytest.mark.parametrize("dtype,arch,seed,rel_tol", [
    (torch.bfloat16, "qwen3", 4, 0.05),  # tied LM head
    (torch.bfloat16, "llama", 4, 0.05),  # untied LM head
    (torch.float16, "qwen3", 5, 0.01),  # an explicit float16 is honoured, not swapped for bf16
])
def test_half_precision_close_to_float32_reference(tiny_models, dtype, arch, seed, rel_tol):
    """bf16 and fp16 use prepacked oneDNN matmuls with fused SiLU*up where the CPU runs
    that dtype in oneDNN, the plain path elsewhere; either way their logits stay within
    the dtype's rounding of the float32 reference."""
    path, hf = tiny_models[arch]
    llm = LLM(str(path), dtype=str(dtype).removeprefix("torch."), num_kv_blocks=128)
    model = llm.engine.runner.model
    assert model.dtype == dtype
    assert_packed_as_the_cpu_allows(model, dtype)
    prompts = random_prompts(LENGTHS, seed=seed)
    for p, (err, scale) in zip(prompts, logit_errors(llm, hf, prompts), strict=True):
        assert err < rel_tol * scale, f"len {len(p)}: {dtype} error {err:.3g} vs logit scale {scale:.3g}"
