"""The bf16 tile kernel (kernels/bf16_linear.cpp) and how bf16 models use it: compiled decode
steps multiply ``Bf16Tiles`` in place of the plain weights, and a tied head's tiles serve the
embedding lookups."""

from __future__ import annotations

import pytest
import torch

from hyprefix import LLM
from hyprefix.kernels import bf16_linear
from hyprefix.models.layers import Embedding
from hyprefix.models.quant import Bf16Tiles, reduction_linear
from tests.kernels.test_decode_graph import _compiled_and_eager_logits
from tests.support.compare import our_last_logits, random_prompts

needs_kernel = pytest.mark.skipif(not bf16_linear.available(),
                                  reason="the bf16 tile kernel needs native bf16 with AVX512-BF16")


def _bf16_ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference in units of want's bf16 spacing (2^-7 of its magnitude, at least 2^-20)."""
    spacing = torch.clamp(want.float().abs(), min=2.0**-13) * 2.0**-7
    return ((got.float() - want.float()).abs() / spacing).max().item()


def test_pack_and_unpack_are_inverse_and_rows_gathers_the_weight():
    w = torch.randn(40, 70).to(torch.bfloat16)  # 40 rows: a padded last tile
    tiles = bf16_linear.pack(w)
    assert tiles.shape == (3, 35, 16, 2)
    assert torch.equal(bf16_linear.unpack(tiles, 40), w)
    assert torch.equal(tiles[2, :, 8:], torch.zeros(35, 8, 2, dtype=torch.bfloat16))
    ids = torch.tensor([[0, 39, 17], [16, 15, 3]])
    assert torch.equal(bf16_linear.rows(tiles, ids, 40), w[ids])
    for bad in (40, 47, -1):  # a padded row, past the tiles, negative: nn.Embedding's error
        with pytest.raises(IndexError, match="out of range"):
            bf16_linear.rows(tiles, torch.tensor([3, bad]), 40)


@needs_kernel
# a padded last tile; K / 2 not a multiple of 4; many tiles (some taken by the other thread)
@pytest.mark.parametrize("n,k", [(16, 32), (40, 70), (100, 1030), (1000, 64)])
@pytest.mark.parametrize("m", [1, 3, 4, 6, 9, 16])
def test_kernel_matches_a_float32_matmul(n, k, m):
    """Products of bf16 values are exact in float32; the kernel sums them in another order
    and rounds once to bf16: within one bf16 step of the float32 matmul's rounding, and
    exactly equal where every sum is exact (small integers)."""
    g = torch.Generator().manual_seed(n * k + m)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    out = bf16_linear.bf16_linear(x, bf16_linear.pack(w), n)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert _bf16_ulps(out, (x.float() @ w.float().t()).to(torch.bfloat16)) <= 1.0
    biased = bf16_linear.bf16_linear(x, bf16_linear.pack(w), n, bias)  # added before the rounding
    assert _bf16_ulps(biased, (x.float() @ w.float().t() + bias.float()).to(torch.bfloat16)) <= 1.0
    wi = torch.randint(-4, 5, (n, k), generator=g).to(torch.bfloat16)
    xi = torch.randint(-4, 5, (2, m, k), generator=g).to(torch.bfloat16)  # leading dims kept
    bi = torch.randint(-8, 9, (n,), generator=g).to(torch.bfloat16)
    exact = bf16_linear.bf16_linear(xi, bf16_linear.pack(wi), n, bi)
    want = (xi.float() @ wi.float().t() + bi.float()).to(torch.bfloat16)
    assert exact.shape == (2, m, n) and torch.equal(exact, want)
    odd = torch.empty(m * k + 1, dtype=torch.bfloat16)[1:].view(m, k)  # data at an odd address: copied first
    odd.copy_(xi[0])
    assert torch.equal(bf16_linear.bf16_linear(odd, bf16_linear.pack(wi), n, bi), want[0])


@needs_kernel
def test_kernel_rejects_what_it_cannot_take():
    tiles = bf16_linear.pack(torch.randn(32, 64).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="bfloat16"):
        bf16_linear.bf16_linear(torch.randn(1, 64), tiles, 32)
    with pytest.raises(RuntimeError, match="columns"):
        bf16_linear.bf16_linear(torch.randn(1, 48).to(torch.bfloat16), tiles, 32)
    with pytest.raises(RuntimeError, match="rows in"):
        bf16_linear.bf16_linear(torch.randn(1, 64).to(torch.bfloat16), tiles, 33)
    with pytest.raises(RuntimeError, match="bias"):
        bf16_linear.bf16_linear(torch.randn(1, 64).to(torch.bfloat16), tiles, 32, torch.zeros(31, dtype=torch.bfloat16))
    assert bf16_linear.bf16_linear(torch.empty(0, 64, dtype=torch.bfloat16), tiles, 32).shape == (0, 32)


def test_bf16_tiles_off_the_kernel_multiply_the_plain_weight():
    """Another dtype (or a CPU without the kernel's path) multiplies the unpacked weight."""
    w = torch.randn(24, 32).to(torch.bfloat16)
    bias = torch.randn(24)
    weight = Bf16Tiles(bf16_linear.pack(w), 24)
    x = torch.randn(2, 32)
    assert torch.allclose(weight.matmul(x, bias), x @ w.float().t() + bias)
    assert torch.allclose(reduction_linear(x, weight, None), x @ w.float().t())


@pytest.mark.slow
@needs_kernel
@pytest.mark.batched_graphs
@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])  # tied head; untied head; q/k/v bias, tied
def test_bf16_compiled_steps_read_tiles_and_match_eager(tiny_models, arch):
    """With compiled decode steps a bf16 model keeps each linear (and a tied head) as tiles
    in place of the plain copy beside oneDNN's prepacked one; a tied head's tiles replace the
    embedding table (the lookups gather from them), so they add nothing (the tiny vocabulary
    fills whole tiles); the compiled step's logits stay within bf16 rounding of the eager step's."""
    path, _ = tiny_models[arch]
    llm = LLM(str(path), dtype="bfloat16", num_kv_blocks=128, block_size=16)
    eager_only = LLM(str(path), dtype="bfloat16", num_kv_blocks=128, block_size=16, enforce_eager=True)
    model, plain = llm.engine.runner.model, eager_only.engine.runner.model
    layer = model.layers[0]
    for linear in (layer.attn.qkv, layer.attn.o_proj, layer.mlp.gate_up, layer.mlp.down):
        tiles = linear.forms.bf16
        assert tiles is not None and linear.weight.numel() == 0
        graph_weight = linear.forms.graph_weight(linear.weight)
        assert isinstance(graph_weight, Bf16Tiles) and graph_weight.tiles is tiles.tiles
    for linear, reference in ((layer.attn.qkv, plain.layers[0].attn.qkv), (layer.mlp.down, plain.layers[0].mlp.down)):
        x = torch.randn(3, linear.in_features).to(torch.bfloat16)
        assert torch.equal(linear(x), reference(x))  # eager steps: the same prepacked matmul
    linear_tiles = [t for n, t in model.named_buffers() if n.endswith("bf16_tiles") and not n.startswith("embed.")]
    assert model.weight_memory_bytes() == plain.weight_memory_bytes() + sum(t.nbytes for t in linear_tiles)
    if arch != "llama":
        assert isinstance(model.embed, Embedding) and model.embed.weight.numel() == 0
        ids = torch.tensor([0, 5, 4095])
        assert torch.equal(model.embed(ids), plain.embed(ids))
    else:
        assert model.embed.forms.bf16 is None and model.lm_head.forms.bf16 is not None
    prompts = random_prompts((33, 9, 20), seed=5)
    our_last_logits(llm, [p[:-1] for p in prompts])
    compiled, eager = _compiled_and_eager_logits(llm, prompts[:1])
    scale = eager.abs().max().item()
    assert (compiled - eager).abs().max().item() < 0.05 * scale
    # the batched graph: oneDNN's prepacked bf16 matmuls, as eager steps (tiles read only at batch 1)
    assert llm.engine.runner.decode_graphs.batched
    llm.engine.cache.kv.free("d0")
    compiled, eager = _compiled_and_eager_logits(llm, prompts)
    assert compiled.shape[0] == 3 and (compiled - eager).abs().max().item() < 0.05 * scale
