"""The Gated DeltaNet scan against a float64 token-by-token oracle, and the Qwen3.5
checkpoint layouts the tiny-model tests in test_hybrid_vs_hf.py do not cover: the
language model of a Qwen3_5ForConditionalGeneration checkpoint and Qwen3.5-MoE."""

from __future__ import annotations

import json

import pytest
import torch

from hyprefix import LLM, SamplingParams
from hyprefix.models.gated_deltanet import gated_delta_scan
from tests.support.compare import hf_greedy, logit_errors, random_prompts
from tests.support.models import _tiny_hybrid_config, save_tiny_checkpoint, vary_deltanet_weights


def _oracle(q, k, v, g, beta, h0):
    """The gated delta rule one token at a time, float64."""
    q, k, v, g, beta, h = (x.double() for x in (q, k, v, g, beta, h0))
    outs, states = [], []
    for t in range(q.shape[0]):
        h = h * torch.exp(g[t])[:, None, None]
        delta = (v[t] - torch.einsum("hkv,hk->hv", h, k[t])) * beta[t][:, None]
        h = h + k[t][:, :, None] * delta[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", h, q[t]))
        states.append(h)
    return torch.stack(outs), states


def _inputs(n: int, heads: int = 4, kd: int = 16, vd: int = 8, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(n, heads, kd, generator=gen), dim=-1) * kd ** -0.5
    k = torch.nn.functional.normalize(torch.randn(n, heads, kd, generator=gen), dim=-1)
    v = torch.randn(n, heads, vd, generator=gen)
    # decays from almost none to strong, as A_log spans them in real checkpoints
    g = -torch.tensor([0.01, 0.3, 2.0, 12.0])[:heads] * torch.rand(n, heads, generator=gen)
    beta = torch.rand(n, heads, generator=gen)
    h0 = torch.randn(heads, kd, vd, generator=gen)
    return q, k, v, g, beta, h0


@pytest.mark.parametrize(("n", "chunk", "cuts"), [
    (1, 64, []), (3, 64, [1, 2]), (57, 64, [16, 56]), (130, 64, [1, 63, 64, 65, 128]), (130, 16, [7, 100])])
def test_scan_matches_token_by_token_oracle(n, chunk, cuts):
    q, k, v, g, beta, h0 = _inputs(n)
    o, h, tapped = gated_delta_scan(q, k, v, g, beta, h0, chunk, cuts)
    ref, states = _oracle(q, k, v, g, beta, h0)
    assert (o.double() - ref).abs().max().item() < 1e-5
    assert (h.double() - states[-1]).abs().max().item() < 1e-5
    assert len(tapped) == len(cuts)
    for cut, state in zip(cuts, tapped, strict=True):
        assert (state.double() - states[cut - 1]).abs().max().item() < 1e-5, f"tap at {cut}"


def test_tap_does_not_change_the_output():
    """A checkpoint inside a prefill ends a chunk there; outputs and final state stay the same."""
    q, k, v, g, beta, h0 = _inputs(100, seed=3)
    plain = gated_delta_scan(q, k, v, g, beta, h0, 64, [])
    tapped = gated_delta_scan(q, k, v, g, beta, h0, 64, [5, 70])
    assert torch.allclose(plain[0], tapped[0], atol=1e-5) and torch.allclose(plain[1], tapped[1], atol=1e-5)


def test_one_checkpoint_holds_recurrent_layers_of_different_shapes():
    """A model mixing kinds of recurrent layers: each layer's live and checkpoint
    tensors get its own shape, and one checkpoint costs the sum of their bytes."""
    from hyprefix.engine_config import RunnerConfig
    from hyprefix.models.base import KVLayout
    from hyprefix.models.recurrent_state import LayerStateShape, StateLayout
    from hyprefix.runner.model_runner import ModelRunner, PoolSizes

    mamba, deltanet = LayerStateShape(96, 3, (8, 16, 16)), LayerStateShape(64, 3, (4, 16, 8))
    layout = StateLayout((mamba, deltanet, mamba))

    class Model(torch.nn.Module):
        kv_layout = KVLayout(0, 1, 1)
        state_layout = layout

    expected = 2 * (96 * 3 * 2 + 8 * 16 * 16 * 4) + 64 * 3 * 2 + 4 * 16 * 8 * 4  # bf16 conv, float32 matrix
    assert ModelRunner.state_bytes_per_slot(Model(), torch.bfloat16) == expected
    runner = ModelRunner(Model(), PoolSizes(torch.bfloat16, 4, 16, num_live_slots=2, num_checkpoint_slots=3),
                         RunnerConfig("cpu", False, False, 0, "raw_logprobs", 0, 2, 4.0))
    assert [tuple(s.matrix.shape) for s in runner.recurrent_states] == [(2, 8, 16, 16), (2, 4, 16, 8), (2, 8, 16, 16)]
    assert [tuple(s.ckpt_conv.shape) for s in runner.recurrent_states] == [(3, 96, 3), (3, 64, 3), (3, 96, 3)]
    assert all(s.matrix.dtype == torch.float32 and s.conv.dtype == torch.bfloat16 for s in runner.recurrent_states)
    runner.recurrent_states[1].matrix[0].fill_(1.0)
    runner.recurrent_states[1].tap(2, runner.recurrent_states[1].conv[0], runner.recurrent_states[1].matrix[0])
    runner._apply_state_ops([(2, 1)])  # restore checkpoint 2 into live slot 1: a copy
    assert torch.equal(runner.recurrent_states[1].matrix[1], torch.ones(4, 16, 8))
    runner.recurrent_states[1].matrix[1].zero_()
    assert runner.recurrent_states[1].ckpt_matrix[2].eq(1).all()


def test_qwen3_5_conditional_generation_checkpoint_runs_its_language_model(tmp_path):
    """What the hub's Qwen3.5 repos hold: ``model.language_model.*`` weights and a
    ``text_config``, plus a vision tower that is skipped."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = _tiny_hybrid_config("qwen3_5").to_dict()
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  num_position_embeddings=16, patch_size=4)
    config = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = Qwen3_5ForConditionalGeneration(config).eval()
    vary_deltanet_weights(hf)
    save_tiny_checkpoint(hf, tmp_path)
    names = set(json.loads((tmp_path / "config.json").read_text())["architectures"])
    assert names == {"Qwen3_5ForConditionalGeneration"}

    llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=64)
    prompts = random_prompts((3, 40), seed=5)
    assert all(err < 1e-4 for err, _ in logit_errors(llm, hf, prompts))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 6) for p in prompts]


def test_qwen3_5_moe_matches_transformers(tmp_path):
    """Every layer a sparse MoE block (normalised top-k, shared expert with its gate);
    attention with q/k/v/o biases (q_proj's split into query and gate rows)."""
    from transformers import AutoModelForCausalLM, Qwen3_5MoeTextConfig

    base = _tiny_hybrid_config("qwen3_5").to_dict()
    keep = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
            "linear_value_head_dim", "linear_conv_kernel_dim", "max_position_embeddings", "rope_parameters",
            "layer_types", "initializer_range", "eos_token_id", "bos_token_id", "pad_token_id")
    config = Qwen3_5MoeTextConfig(**{k: base[k] for k in keep}, num_experts=6, num_experts_per_tok=2,
                                  moe_intermediate_size=32, shared_expert_intermediate_size=40, attention_bias=True)
    torch.manual_seed(1)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    vary_deltanet_weights(hf)
    save_tiny_checkpoint(hf, tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16)
    prompts = random_prompts((2, 16, 57), seed=6)
    assert all(err < 1e-4 for err, _ in logit_errors(llm, hf, prompts, chunk=9))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 6) for p in prompts]



@pytest.mark.parametrize("activation", ["silu", "relu2"])
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_grouped_experts_equal_one_matmul_pair_per_expert(rows, activation):
    """The CPU path (one grouped matmul per projection over tokens sorted by expert,
    experts nobody chose left empty) against the per-expert loop other devices run, and the
    op ``hyprefix::moe_experts`` (which picks the CPU path here) against both; gated SiLU experts
    and ungated ReLU^2 ones (NemotronH), whose gate_up holds the up rows alone."""
    from hyprefix.models.fused_moe import ExpertActivation, grouped_experts, looped_experts, moe_experts

    gen = torch.Generator().manual_seed(rows)
    rows_up = 32 if activation == "silu" else 16
    gate_up, down = torch.randn(9, rows_up, 24, generator=gen) / 4, torch.randn(9, 24, 16, generator=gen) / 4
    x = torch.randn(rows, 24, generator=gen)
    chosen = torch.stack([torch.randperm(9, generator=gen)[:3] for _ in range(rows)])
    weights = torch.rand(rows, 3, generator=gen)
    grouped = grouped_experts(x, chosen, weights, gate_up, down, ExpertActivation(activation))
    looped = looped_experts(x, chosen, weights, gate_up, down, ExpertActivation(activation))
    torch.testing.assert_close(grouped, looped, rtol=1e-5, atol=1e-6)
    assert grouped.abs().max() > 0.1
    torch.testing.assert_close(moe_experts(x, chosen, weights, gate_up, down, activation), grouped, rtol=0, atol=0)


def test_experts_with_one_projection_in_blocks_multiply_it_dequantized():
    """Where only one projection of a MoE block holds low-bit tiles (its plain tensor gone), the
    experts run the float op over those tiles dequantized: equal to the float op on the
    dequantized stack."""
    from hyprefix.kernels import quant_linear
    from hyprefix.models.fused_moe import Experts, moe_experts, moe_forward
    from hyprefix.models.layers import drop_plain
    from hyprefix.models.quant import quantize_low_bit

    if not quant_linear.available():
        pytest.skip("the quant kernels do not run on this CPU")
    gen = torch.Generator().manual_seed(4)
    gate_up, down = Experts(4, 64, 64, torch.float32, torch.device("cpu")), Experts(4, 64, 32, torch.float32,
                                                                                   torch.device("cpu"))
    for experts in (gate_up, down):
        experts.weight.data.copy_(torch.randn(experts.weight.shape, generator=gen) / 4)
    gate_up.forms.use_quant(quantize_low_bit(gate_up.weight.detach()))
    drop_plain(gate_up.weight)
    x = torch.randn(3, 64, generator=gen)
    chosen, weights = torch.tensor([[0, 2], [2, 3], [1, 0]]), torch.rand(3, 2, generator=gen)
    got = moe_forward(x, chosen, weights, gate_up, down)
    deq = gate_up.forms.quant.dequantize(torch.float32).view(4, 64, 64)
    torch.testing.assert_close(got, moe_experts(x, chosen, weights, deq, down.stacked(torch.float32), "silu"), rtol=0,
                               atol=0)
    assert got.abs().max() > 0.01
