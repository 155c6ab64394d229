"""Gemma 3 (text) vs transformers on tiny float32 weights: sliding and full layers with
their own RoPE, sandwich norms, tanh-GELU MLP; prompts shorter and much longer than
the sliding window, chunked prefill, decoding and prefix hits across the window."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from hyprefix import LLM, SamplingParams
from hyprefix.hardware import device_caps
from hyprefix.models.gemma3 import Gemma3ForCausalLM
from hyprefix.models.layers import GatedMLP
from hyprefix.models.registry import model_class
from tests.support.compare import hf_greedy, logit_errors, random_prompts
from tests.support.models import GEMMA3_WINDOW, TINY_CASCADE

LOGIT_ATOL = 1e-4  # float32; observed max error ~5e-6
LENGTHS = (3, GEMMA3_WINDOW - 1, GEMMA3_WINDOW, GEMMA3_WINDOW + 1, 57, 130)
GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)  # short prompts decode past the window


def test_config_routing_and_refusals(gemma3_model):
    _, hf = gemma3_model
    config = hf.config
    assert model_class(config) is Gemma3ForCausalLM
    gguf_like = type(config).from_dict({**config.to_dict(), "architectures": None})  # model_type only
    assert model_class(gguf_like) is Gemma3ForCausalLM
    for field, value in [("final_logit_softcapping", 30.0), ("attn_logit_softcapping", 50.0),
                         ("use_bidirectional_attention", True)]:
        unsupported = type(config).from_dict({**config.to_dict(), field: value})
        with pytest.raises(ValueError, match=field):
            Gemma3ForCausalLM(unsupported, torch.float32, torch.device("meta"), 64)


def test_packed_tanh_gelu_mlp_equals_the_plain_one():
    torch.manual_seed(0)
    mlp = GatedMLP(64, 96, False, torch.float32, torch.device("cpu"), activation="gelu_pytorch_tanh")
    mlp.requires_grad_(False)
    mlp.gate_up.weight.normal_(0, 0.3)
    mlp.down.weight.normal_(0, 0.3)
    x = torch.randn(13, 64)
    gate, up = F.linear(x, mlp.gate_up.weight).split(96, dim=-1)
    ref = F.linear(F.gelu(gate, approximate="tanh") * up, mlp.down.weight)
    mlp.gate_up.pack()
    assert (mlp.gate_up.forms.packed_halves is not None) is device_caps("cpu").prepack(torch.float32)
    torch.testing.assert_close(mlp(x), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [None, 9])  # 9: prefill split below the window
def test_logits_close(gemma3_model, chunk):
    path, hf = gemma3_model
    llm = LLM(str(path), dtype="float32", num_kv_blocks=128, block_size=16)
    model = llm.engine.runner.model
    assert model.kv_layout.windows == (GEMMA3_WINDOW, None, GEMMA3_WINDOW, GEMMA3_WINDOW, None)
    assert (model.layers[0].mlp.gate_up.forms.packed_halves is not None) is device_caps("cpu").prepack(torch.float32)
    prompts = random_prompts(LENGTHS, seed=1)
    for p, (err, _) in zip(prompts, logit_errors(llm, hf, prompts, chunk), strict=True):
        assert err < LOGIT_ATOL, f"prompt len {len(p)}: max |logit diff| {err:.2e}"


@pytest.mark.parametrize("block_size", [16, 7])
def test_greedy_matches_hf_generate(gemma3_model, block_size):
    """Prefill chunks (16 tokens) shorter than the window, decodes past it."""
    path, hf = gemma3_model
    llm = LLM(str(path), dtype="float32", num_kv_blocks=256, block_size=block_size,
              max_num_batched_tokens=16, **TINY_CASCADE)
    prompts = random_prompts((5, GEMMA3_WINDOW + 3, 57, 130), seed=2)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for p, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, p, GREEDY.max_tokens), f"len {len(p)}"
    llm.check_invariants()


def test_prefix_hits_across_the_window(gemma3_model):
    """Round 2 shares prefixes longer than the window with round 1 (one a full repeat)."""
    path, hf = gemma3_model
    llm = LLM(str(path), dtype="float32", num_kv_blocks=256, block_size=8, max_num_batched_tokens=16,
              **TINY_CASCADE)
    a, b, tail_a, tail_b = random_prompts((70, 45, 13, 9), seed=3)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    rounds = [[a, b], [a[:50] + tail_a, a, b[:40] + tail_b]]
    for i, prompts in enumerate(rounds):
        outs = llm.generate(prompts, params, use_tqdm=False)
        for p, out in zip(prompts, outs, strict=True):
            assert out.outputs[0].token_ids == hf_greedy(hf, p, params.max_tokens), f"round {i} len {len(p)}"
            if i == 1:
                assert out.num_cached_tokens > GEMMA3_WINDOW, f"len {len(p)}: {out.num_cached_tokens} cached"
    llm.check_invariants()


@pytest.mark.parametrize("prefix,vision", [
    ("model.language_model.", True),  # transformers 5 names, vision tower present
    ("language_model.model.", False),  # older names, text weights only
])
def test_multimodal_checkpoint_loads_the_language_model(gemma3_model, tmp_path, prefix, vision):
    """A Gemma3ForConditionalGeneration checkpoint (config nests ``text_config``) loads
    through the engine, skipping vision tensors, into the same logits."""
    from safetensors.torch import load_file, save_file
    from transformers import Gemma3Config

    path, hf = gemma3_model
    config = Gemma3Config(text_config=hf.config.to_dict(), vision_config={
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
        "image_size": 28, "patch_size": 14})
    config.architectures = ["Gemma3ForConditionalGeneration"]
    config.save_pretrained(tmp_path)
    weights = {prefix + name.removeprefix("model."): t for name, t in load_file(path / "model.safetensors").items()}
    if vision:
        vision_prefix = "model." if prefix.startswith("model.") else ""
        weights[f"{vision_prefix}vision_tower.vision_model.post_layernorm.weight"] = torch.ones(32)
        weights[f"{vision_prefix}multi_modal_projector.mm_input_projection_weight"] = torch.ones(32, 64)
    save_file(weights, tmp_path / "model.safetensors")
    shutil.copy(path / "tokenizer.json", tmp_path / "tokenizer.json")

    llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=128, block_size=16)
    assert isinstance(llm.engine.runner.model, Gemma3ForCausalLM)
    prompts = random_prompts((7, 57), seed=4)
    assert all(err < LOGIT_ATOL for err, _ in logit_errors(llm, hf, prompts, chunk=9))


def test_bf16_close_to_float32_reference(gemma3_model):
    path, hf = gemma3_model
    llm = LLM(str(path), dtype="bfloat16", num_kv_blocks=128)
    model = llm.engine.runner.model
    assert model.dtype == torch.bfloat16
    assert (model.layers[0].mlp.gate_up.forms.packed_halves is not None) is device_caps("cpu").prepack(torch.bfloat16)
    prompts = random_prompts(LENGTHS, seed=5)
    for p, (err, scale) in zip(prompts, logit_errors(llm, hf, prompts), strict=True):
        assert err < 0.05 * scale, f"len {len(p)}: bf16 error {err:.3g} vs logit scale {scale:.3g}"
