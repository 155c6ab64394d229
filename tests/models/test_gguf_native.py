"""A GGUF's quantized matrices stay quantized by default (``models/gguf_weights.py``): a tiny
Llama file whose matrices are Q4_K, Q6_K, Q4_0, Q5_0, Q4_1 and Q8_0 blocks (a fused q/k/v and
gate/up of two formats each, a 6-bit head, a 4-bit embedding table with no float copy) loads into the kernels'
tiles with the file's numbers, computes what the dequantized file computes with activations
rounded per 32, and decodes the same tokens eagerly, through the compiled step and through the
one-call decode kernel; ``--quantization none`` reads it as floats, ``int4`` quantizes an HF
checkpoint."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from hyprefix import LLM, SamplingParams
from hyprefix.kernels import quant_linear as quant_kernel
from hyprefix.models.layers import Linear
from hyprefix.models.loader import load_model
from hyprefix.models.quant import QuantTiles, part_format, quantize_activations
from tests.kernels.test_quant_kernel import random_blocks
from tests.models.test_gguf_errors import TENSORS, write_gguf
from tests.support.compare import our_last_logits

pytestmark = pytest.mark.skipif(not quant_kernel.available(), reason="quant_linear does not build or run here")

T = gguf.GGMLQuantizationType
TYPES = {"blk.0.attn_q.weight": "Q4_K", "blk.0.attn_k.weight": "Q4_K", "blk.0.attn_v.weight": "Q6_K",
         "blk.0.attn_output.weight": "Q4_0", "blk.0.ffn_gate.weight": "Q4_K", "blk.0.ffn_up.weight": "Q5_0",
         "blk.0.ffn_down.weight": "Q8_0", "output.weight": "Q6_K", "token_embd.weight": "Q4_1"}


@pytest.fixture(scope="module")
def native_file(tmp_path_factory) -> Path:
    return write_mixed_gguf(tmp_path_factory.mktemp("native") / "mixed.gguf")


def write_mixed_gguf(path: Path) -> Path:
    """The tiny Llama of ``test_gguf_errors`` with its matrices in the types of ``TYPES``."""
    rng = np.random.default_rng(0)
    tensors = {}
    for i, (name, shape) in enumerate(TENSORS.items()):
        kind = TYPES.get(name)
        if kind == "Q8_0":
            tensors[name] = (gguf.quantize(rng.standard_normal(shape).astype(np.float32) * 0.05, T.Q8_0), T.Q8_0)
        elif kind is not None:
            tensors[name] = (random_blocks(kind, *shape, seed=i), T[kind])
        else:
            tensors[name] = 1 + 0.1 * rng.standard_normal(shape).astype(np.float32)
    return write_gguf(path, tensors=tensors)


def test_matrices_keep_the_files_blocks(native_file):
    """Every linear and the untied head hold tiles (q/k/v: two Q4K parts joined and one Q6 part),
    equal to the file dequantized as floats (``--quantization none``) exactly; the embedding
    table is its Q4_1 tiles only (no float copy) and its lookups return the file's rows."""
    cpu = torch.device("cpu")
    floats = load_model(str(native_file), "float32", cpu, 64, quantization="none", compiled_decode=True).model
    native = load_model(str(native_file), "float32", cpu, 64).model
    reference = dict(floats.named_modules())
    for name, module in native.named_modules():
        if not isinstance(module, Linear):
            continue
        tiles = module.forms.quant
        assert isinstance(tiles, QuantTiles) and not module.weight.numel(), name
        assert torch.equal(tiles.dequantize(torch.float32), reference[name].weight), name
    qkv = native.layers[0].attn.qkv.forms.quant.tensors
    assert [part_format(qkv[i:i + 3]) for i in range(0, len(qkv), 3)] == ["q4k", "q6"]  # q and k joined, then v
    gate_up = native.layers[0].mlp.gate_up.forms.quant.tensors
    assert [part_format(gate_up[i:i + 3]) for i in range(0, len(gate_up), 3)] == ["q4k", "int8"]  # up: Q5_0
    assert not native.embed.weight.numel()
    ids = torch.tensor([[0, 15, 3]])
    assert torch.equal(native.embed(ids), floats.embed(ids))
    file_bytes = sum(t.n_bytes for t in gguf.GGUFReader(str(native_file)).tensors)
    assert native.weight_memory_bytes() <= 1.15 * file_bytes
    assert floats.weight_memory_bytes() > 3 * file_bytes


def test_native_model_computes_the_dequantized_files_numbers(native_file, tiny_models):
    """Each linear is its dequantized matrix times its input rounded to int8 per 32; the model's
    logits stay within 3 % of the float model's; greedy tokens are the same eagerly, through the
    compiled decode step and through the one-call decode kernel (which runs the decode steps
    where it builds)."""
    common = {"dtype": "float32", "num_kv_blocks": 64, "tokenizer": str(tiny_models["llama"][0])}
    floats = LLM(str(native_file), quantization="none", enforce_eager=True, **common)
    eager = LLM(str(native_file), enforce_eager=True, **common)
    compiled = LLM(str(native_file), **common)
    qkv = eager.engine.runner.model.layers[0].attn.qkv
    x = torch.randn(5, qkv.in_features)
    expected = quantize_activations(x).double() @ qkv.forms.quant.dequantize(torch.float64).T
    assert torch.allclose(qkv(x).double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    prompts = [[1, 5, 7, 3, 9, 2], [4, 4, 8, 15, 0, 11, 6, 1, 2, 3]]
    ref = our_last_logits(floats, prompts)
    gap = (our_last_logits(eager, prompts) - ref).abs().max().item()
    assert gap < 0.03 * ref.abs().max().item(), f"native logits differ by {gap:.3g}"
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for prompt in prompts:  # one at a time: batch-1 decode steps are the kernel's or the compiled ones
        want = eager.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
        assert compiled.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids == want
    batch = compiled.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in batch] == \
        [o.outputs[0].token_ids for o in eager.generate(prompts, greedy, use_tqdm=False)]
    model = compiled.engine.runner.model
    from hyprefix.kernels import decode_layers

    assert model.decode_kernel == decode_layers.available()


def test_int4_quantizes_a_checkpoint(tiny_models):
    """``quantization="int4"``: an HF checkpoint's linears and head as Q4 tiles, each within half
    a step of its group of the float weight and multiplied as the kernel's dequantized matrix
    times int8 activations; the logits point the float model's way (random weights: 4-bit noise
    is large, so their direction, not their values); greedy decoding through the compiled step."""
    path = str(tiny_models["llama"][0])
    floats = LLM(path, dtype="float32", num_kv_blocks=64, enforce_eager=True)
    int4 = LLM(path, dtype="float32", num_kv_blocks=64, quantization="int4")
    model = int4.engine.runner.model
    assert all(isinstance(m.forms.quant, QuantTiles) for m in model.modules() if isinstance(m, Linear))
    prompts = [[1, 5, 7, 3, 9, 2, 40, 41]]
    ref = our_last_logits(floats, prompts)
    got = our_last_logits(int4, prompts)
    assert torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0) > 0.9
    linear = model.layers[0].mlp.down
    weight, tiles = tiny_models["llama"][1].model.layers[0].mlp.down_proj.weight.detach(), linear.forms.quant
    groups = weight.detach().unflatten(1, (-1, 32))
    step = (groups.amax(-1) - groups.amin(-1)) / 15
    error = (tiles.dequantize(torch.float32) - weight).unflatten(1, (-1, 32)).abs()
    assert (error <= step[..., None] * 0.51 + 1e-3 * weight.abs().max()).all()
    x = torch.randn(3, linear.in_features)
    expected = quantize_activations(x).double() @ tiles.dequantize(torch.float64).T
    assert torch.allclose(linear(x).double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    out = int4.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6
