"""``hyprefix::decode_layers`` (kernels/decode_layers.cpp): every layer of an int8 Llama-family
decode step in one kernel call equals the layers run op by op, on the same weights and K/V."""

from __future__ import annotations

import pytest
import torch

from hyprefix import LLM
from hyprefix.kernels import decode_layers
from hyprefix.models.moe import SparseMoE
from hyprefix.models.quant import Int8Weight
from tests.kernels.test_decode_graph import _decode_batch
from tests.support.compare import our_last_logits, random_prompts

pytestmark = pytest.mark.skipif(not decode_layers.available(), reason="the decode_layers kernel does not run here")


def _both_paths(llm, prompts: list[list[int]]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One decode step of ``prompts`` (their K/V but the last token's filled first) through
    the kernel and op by op, from the same cache: (hidden states, logits, the K/V rows each
    wrote) of each."""
    runner = llm.engine.runner
    model = runner.model
    our_last_logits(llm, [p[:-1] for p in prompts])  # fills their K/V (freed blocks keep it)
    batch = _decode_batch(llm, prompts)
    assert model.decode_kernel and batch.reads_tables_whole()
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    results = []
    for kernel in (True, False):
        for (k, v), (k0, v0) in zip(runner.kv_caches, before, strict=True):
            k.copy_(k0)
            v.copy_(v0)
        model.decode_kernel = kernel
        with torch.inference_mode():
            hidden = model(batch, runner.kv_caches, None)
            logits = model.compute_logits(hidden[batch.logits_indices])
        written = torch.stack([c.flatten(0, 1)[batch.slot_mapping] for pair in runner.kv_caches for c in pair])
        results.append({"hidden": hidden, "logits": logits, "kv": written})
        if kernel:  # the whole step, head and argmax included, from the same cache
            for (k, v), (k0, v0) in zip(runner.kv_caches, before, strict=True):
                k.copy_(k0)
                v.copy_(v0)
            with torch.inference_mode():
                whole, greedy = model.decode_logits(batch, runner.kv_caches)
            gap = (whole - logits).abs().max().item()
            assert gap <= 1e-4 * logits.abs().max().item(), f"the whole step's logits differ by {gap:.3g}"
            assert torch.equal(greedy, whole.argmax(-1))
    model.decode_kernel = True
    for i in range(len(prompts)):
        llm.engine.cache.kv.free(f"d{i}")  # _decode_batch's
    return results[0], results[1]


def _assert_close(kernel: dict[str, torch.Tensor], ops: dict[str, torch.Tensor], within: float = 2e-3) -> None:
    """Float32 rounding apart, except where it moved an activation across an int8 rounding
    boundary: within 0.2 % of each tensor's scale (``within``), the same greedy token for every row."""
    for name in ("hidden", "logits", "kv"):
        gap = (kernel[name] - ops[name]).abs().max().item()
        scale = ops[name].abs().max().item()
        assert gap <= within * scale, f"{name}: kernel and ops differ by {gap:.3g} (scale {scale:.3g})"
    assert torch.equal(kernel["logits"].argmax(-1), ops["logits"].argmax(-1))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_decode_layers_equal_the_layers_op_by_op(tiny_models, arch):
    """Rows of different context lengths (one inside its first block, others across blocks)
    in one step; llama: untied head and llama3 RoPE, qwen2: q/k/v biases, qwen3: QK-norm and
    a head dim unlike hidden / heads, mistral: a sliding window (24) shorter than most rows'
    contexts."""
    path, _ = tiny_models[arch]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=128, block_size=16, quantization="int8",
              enforce_eager=True)
    kernel, ops = _both_paths(llm, random_prompts((5, 17, 40, 70), seed=11))
    _assert_close(kernel, ops)
    llm.check_invariants()


def test_decode_layers_take_per_group_scales(tiny_models):
    """GGUF Q8_0's layout: float16 scales per group of 32 (the other tests' weights have one
    float32 scale per row)."""
    path, _ = tiny_models["llama"]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=128, block_size=16, quantization="int8",
              enforce_eager=True)
    model = llm.engine.runner.model
    generator = torch.Generator().manual_seed(0)
    for layer in model.layers:
        for linear in (layer.attn.qkv, layer.attn.o_proj, layer.mlp.gate_up, layer.mlp.down):
            plain = linear.forms.int8.plain()
            groups = plain.qweight.shape[1] // 32
            scales = (plain.scales[:, None] * (0.5 + torch.rand(plain.qweight.shape[0], groups, generator=generator)))
            linear.use_int8(Int8Weight(plain.qweight, scales.half().float()))
    assert model.layers[0].attn.qkv.forms.int8.scales.dim() == 3 and model.use_decode_kernel()
    kernel, ops = _both_paths(llm, random_prompts((9, 33), seed=12))
    _assert_close(kernel, ops)


def test_decode_layers_serve_only_what_they_fit(tiny_models):
    """int8 float32 models take the kernel; float weights and bfloat16 keep the layers op by op."""
    path, _ = tiny_models["qwen3"]
    assert LLM(str(path), dtype="float32", num_kv_blocks=64, quantization="int8").engine.runner.model.decode_kernel
    assert not LLM(str(path), dtype="float32", num_kv_blocks=64).engine.runner.model.decode_kernel
    assert not LLM(str(path), dtype="bfloat16", num_kv_blocks=64,
                   quantization="int8").engine.runner.model.decode_kernel


@pytest.fixture(scope="module")
def tiny_qwen3_moe(tmp_path_factory):
    """A tiny Qwen3-MoE checkpoint (tests/support/models.py's: 8 experts, top 2, renormalised),
    its middle layer dense (``mlp_only_layers``): the one call holds both kinds."""
    from transformers import AutoModelForCausalLM

    from tests.support.models import save_tiny_checkpoint, tiny_moe_config

    torch.manual_seed(0)
    config = tiny_moe_config("qwen3_moe")
    config.mlp_only_layers = [1]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp("decode-moe") / "qwen3_moe"
    save_tiny_checkpoint(model, path)
    return path


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_decode_layers_run_qwen3_moe_blocks(tiny_qwen3_moe, quantization):
    """Qwen3-MoE's sparse blocks inside the one call (``decode_moe.h``) equal quant_moe op by op:
    rows that share experts and rows that do not, int8 and low-bit expert tiles; and a row's
    result is the same whether it decodes alone or beside others."""
    llm = LLM(str(tiny_qwen3_moe), dtype="float32", num_kv_blocks=128, block_size=16, quantization=quantization,
              enforce_eager=True)
    model = llm.engine.runner.model
    moe = [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoE)]
    assert model.decode_kernel and len(moe) == 2 and all(mlp.fits_decode_kernel() for mlp in moe)
    prompts = random_prompts((6, 19, 40, 70), seed=13)
    kernel, ops = _both_paths(llm, prompts)
    # An expert's input across an int8 rounding boundary moves its row further than a dense
    # MLP's does, int4 experts most (one row 0.5 % of the scale under AVX2, the rest 1e-6):
    # wrong routing or tiles would be off by the scale itself.
    _assert_close(kernel, ops, within=2e-2)
    alone, _ = _both_paths(llm, prompts[2:3])
    torch.testing.assert_close(alone["hidden"][0], kernel["hidden"][2], rtol=0, atol=0)
    llm.check_invariants()
