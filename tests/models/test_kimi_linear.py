"""Kimi-Linear (``models/kimi_linear.py``, ``models/kimi_delta.py``): Kimi Delta Attention layers
(a per-channel decay, checkpointed at block boundaries as Gated DeltaNet's state is) and NoPE MLA
layers over the latent cache, with dense and MoE feed-forward parts. A tiny random float32 model
greedy-decodes as transformers does, from its hub-form checkpoint and from the ``kimi-linear``
GGUF file llama.cpp's own converter writes; prefix hits on and off give the same tokens when
prompts longer than the step's token budget follow a cached prefix; the chunked KDA scan equals
the token-by-token recurrence; the latent pool in 8-bit rows stays near the float32 cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hyprefix import LLM, SamplingParams
from hyprefix.kernels import quant_linear, recurrent_decode
from hyprefix.models import kimi_delta
from hyprefix.models.fused_moe import Experts
from tests.support.compare import assert_first_step_near, hf_greedy, random_prompts
from tests.support.gguf_convert import run_converter
from tests.support.models import random_varied_model, save_tiny_checkpoint

LENGTHS = (3, 16, 23, 57)  # below, at and across the block size 16 and the chunk budget of 32
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
KINDS = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
# Keys of the hub's config.json that transformers 5 does not save and llama.cpp's converter reads.
HUB_KEYS = {"linear_attn_config": {"full_attn_layers": [2], "kda_layers": [1, 3, 4], "num_heads": 4, "head_dim": 16,
                                   "short_conv_kernel_size": 4},
            "first_k_dense_replace": 2, "moe_router_activation_func": "sigmoid", "mla_use_nope": True}


def _config(**changes):
    from transformers import KimiLinearConfig

    # KDA / MLA / KDA / KDA; dense, dense, then MoE layers: 8 experts top 2 within 2 of 4 groups,
    # renormalised and scaled, a shared expert; MLA value heads wider than the keys' nope part, both
    # whole Q8_0 blocks and 16-row tiles (so a Q8_0 file's W_UK / W_UV keep their blocks)
    fields = dict(vocab_size=4096, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                  routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
                  qk_nope_head_dim=32, v_head_dim=48, n_group=4, topk_group=2, num_experts_per_tok=2,
                  num_local_experts=8, layer_types=KINDS, mlp_layer_types=["dense", "dense", "sparse", "sparse"],
                  linear_head_dim=16, linear_num_heads=4, linear_conv_kernel_dim=4, eos_token_id=2, bos_token_id=0,
                  pad_token_id=0, initializer_range=0.2, max_position_embeddings=1024)
    return KimiLinearConfig(**(fields | changes))


def _as_hub_checkpoint(path: Path) -> None:
    """The checkpoint as the hub has it: dense MLPs under ``mlp.`` (transformers 5 saves them
    under ``block_sparse_moe.``, as it does the MoE blocks) and the hub's config keys."""
    from safetensors.torch import load_file, save_file

    weights = load_file(path / "model.safetensors")
    dense = tuple(f"block_sparse_moe.{proj}_proj." for proj in ("gate", "up", "down"))
    weights = {(name.replace("block_sparse_moe.", "mlp.") if any(d in name for d in dense) else name): t
               for name, t in weights.items()}
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text()) | HUB_KEYS
    (path / "config.json").write_text(json.dumps(config, indent=2))


@pytest.fixture(scope="module")
def kimi(tmp_path_factory) -> tuple[Path, object]:
    """(hub-form checkpoint dir, HF model): norms (the gated output norm included) varied off 1
    and the routers' correction bias off 0, so a misplaced one shows."""
    model = random_varied_model(_config())
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0, 0.3)
    path = tmp_path_factory.mktemp("kimi") / "kimi"
    save_tiny_checkpoint(model, path)
    _as_hub_checkpoint(path)
    return path, model


@pytest.fixture(scope="module")
def kimi_ggufs(kimi, llama_converter, tmp_path_factory) -> dict[str, Path]:
    """outtype (f32, q8_0) -> the ``kimi-linear`` file; the converter reads the expert group count
    as ``n_group`` (the hub's config calls it ``num_expert_group``), so it is given that key."""
    root = tmp_path_factory.mktemp("kimi-gguf")
    out = {kind: root / f"kimi-{kind}.gguf" for kind in ("f32", "q8_0")}
    run_converter(llama_converter, [(["--outtype", kind, "--outfile", str(path), str(kimi[0])], [], {"n_group": 4})
                                    for kind, path in out.items()])
    return out


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_greedy_matches_transformers(kimi, kimi_ggufs, source):
    """float32 greedy tokens equal transformers' with 32 tokens a step (the 57-token prompt in two
    chunks); the cache holds one latent per MLA layer and token, and one conv window plus one
    [heads, dim, dim] state per KDA layer and sequence."""
    path, hf = kimi
    llm = LLM(str(path if source == "hf" else kimi_ggufs["f32"]), dtype="float32", num_kv_blocks=64, block_size=16,
              max_num_batched_tokens=32, log_stats_interval=0)
    model = llm.engine.runner.model
    assert type(model).__name__ == "KimiLinearForCausalLM"
    prompts = random_prompts(LENGTHS, seed=2)
    for prompt, tokens in zip(prompts, _tokens(llm, prompts), strict=True):
        assert tokens == hf_greedy(hf, prompt, GREEDY.max_tokens), f"{source} {len(prompt)}"
    cfg = hf.config
    latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    assert model.kv_layout.num_layers == 1 and model.kv_layout.latent and model.kv_layout.head_dim == latent
    assert [layer.matrix for layer in model.state_layout.layers] == [(4, 16, 16)] * 3
    assert {layer.conv_dim for layer in model.state_layout.layers} == {3 * 4 * 16}
    llm.check_invariants()


def test_cache_on_and_off_agree_over_a_cached_prefix(kimi):
    """Prompts of 30-70 new tokens after a cached 48-token prefix, 32 tokens a step (partial hits
    resumed from a KDA checkpoint at a block boundary, then chunked), and a follow-up turn that
    extends an answered prompt (resumed from a state its decode steps checkpointed): hits on and
    off give the same greedy tokens, and the hits show."""
    path, hf = kimi
    shared = random_prompts((48,), seed=11)[0]
    prompts = [[*shared, *tail] for tail in random_prompts((30, 70, 45), seed=12)]
    kwargs = dict(dtype="float32", num_kv_blocks=96, block_size=16, max_num_batched_tokens=32, log_stats_interval=0)
    cached, plain = LLM(str(path), **kwargs), LLM(str(path), **kwargs, enable_prefix_caching=False)
    cached.generate([shared], SamplingParams(max_tokens=1), use_tqdm=False)
    outs = cached.generate(prompts, GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens >= 32 for o in outs), [o.num_cached_tokens for o in outs]
    tokens = [o.outputs[0].token_ids for o in outs]
    assert tokens == _tokens(plain, prompts)
    assert tokens[0] == hf_greedy(hf, prompts[0], GREEDY.max_tokens)
    # 78 prompt tokens (a checkpoint at 64) and 10 decoded: the decode step past token 80 taps the state there
    follow_up = [*prompts[0], *tokens[0], *random_prompts((9,), seed=13)[0]]
    hit = cached.generate([follow_up], GREEDY, use_tqdm=False)[0]
    assert hit.num_cached_tokens >= 80
    assert hit.outputs[0].token_ids == _tokens(plain, [follow_up])[0]
    assert cached.get_stats()["mamba_checkpoints_used"] > 0
    cached.check_invariants()


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_8bit_latent_cache_near_the_auto_cache(kimi, kv_cache_dtype):
    """The MLA layers' latent pool in 8-bit rows (rotated per part, as DeepSeek's:
    ``deepseek.LatentAttention.rotated``), prompts in chunks of 32: teacher-forced next-token
    distributions near the float32 cache's (KL over the top logprobs, test_kv_cache_dtype's
    bound), the same first greedy token but at a near tie."""
    path, _ = kimi
    prompts = random_prompts((23, 57), seed=4)
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=20)
    kwargs = dict(dtype="float32", num_kv_blocks=64, block_size=16, max_num_batched_tokens=32, log_stats_interval=0)
    outs = {}
    for fmt in ("auto", kv_cache_dtype):
        llm = LLM(str(path), kv_cache_dtype=fmt, **kwargs)
        outs[fmt] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.engine.runner.kv_caches[0][0].shape[-1] == llm.engine.runner.model.kv_layout.head_dim + 2
    for ref, got in zip(outs["auto"], outs[kv_cache_dtype], strict=True):
        assert_first_step_near(ref, got)  # fp8's 3-bit mantissas move a random model's logprobs ~0.1


@pytest.mark.hybrid_graphs
@pytest.mark.skipif(not recurrent_decode.available(), reason="the fused KDA decode op runs on x86")
def test_decode_steps_run_compiled(kimi):
    """Where the fused KDA op runs, every decode step runs in the compiled batch-1 graph (the KDA
    layers' op and the MLA layers' latent attention inside it): transformers' greedy tokens for
    prompts below and across a block, no decode step eager."""
    path, hf = kimi
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, block_size=16, log_stats_interval=0)
    runner = llm.engine.runner
    assert runner.model.decode_graph_capable and runner.decode_graphs is not None
    prompts = random_prompts((3, 23), seed=5)
    for prompt in prompts:
        assert _tokens(llm, [prompt])[0] == hf_greedy(hf, prompt, GREEDY.max_tokens), f"len {len(prompt)}"
    assert runner.decode_steps == {"kernel": 0, "graph": len(prompts) * (GREEDY.max_tokens - 1), "eager": 0}
    llm.check_invariants()


@pytest.mark.skipif(not quant_linear.available(), reason="the quant kernels do not run on this CPU")
def test_q8_0_file_keeps_its_blocks(kimi_ggufs):
    """A Q8_0 ``kimi-linear`` file: the KDA layers' stacked in_proj and o_proj, the MLA layers'
    projections and per-head W_UK / W_UV stacks (``attn_k_b`` / ``attn_v_b``), the MLPs, the
    expert stacks and the LM head stay in the file's blocks (the gates' f_b / g_b, 16 columns, are
    F16 in the file: less than one block); prefix hits on and off give the same greedy tokens."""
    kwargs = dict(dtype="float32", num_kv_blocks=64, block_size=16, log_stats_interval=0)
    cached = LLM(str(kimi_ggufs["q8_0"]), **kwargs)
    model = cached.engine.runner.model
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    assert experts and all(e.forms.quant is not None and not e.weight.numel() for e in experts)
    blocks = [model.lm_head]
    for layer in model.layers:
        mixer = layer.mixer
        blocks += [mixer.in_proj, mixer.o_proj] if layer.kind == "linear_attention" else [
            mixer.q_proj, mixer.kv_a, mixer.o_proj, mixer.w_uk, mixer.w_uv]
        assert layer.kind == "full_attention" or mixer.f_b.forms.quantized is None
        mlp = layer.mlp
        blocks += [mlp.gate_up, mlp.down] if hasattr(mlp, "gate_up") else [mlp.shared.gate_up, mlp.shared.down]
    assert all(m.forms.quantized is not None and not m.weight.numel() for m in blocks)
    prompts = random_prompts((3, 40), seed=7)
    first = _tokens(cached, prompts)
    again = cached.generate([prompts[-1]], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 32 and again.outputs[0].token_ids == first[-1]
    assert _tokens(LLM(str(kimi_ggufs["q8_0"]), **kwargs, enable_prefix_caching=False), prompts) == first


def _oracle(q, k, v, g, beta, h0):
    """The KDA rule one token at a time, float64, head-major inputs ([H, n, *])."""
    q, k, v, g, beta, h = (x.double() for x in (q, k, v, g, beta, h0))
    outs, states = [], []
    for t in range(q.shape[1]):
        h = h * torch.exp(g[:, t])[:, :, None]
        delta = (v[:, t] - torch.einsum("hkv,hk->hv", h, k[:, t])) * beta[:, t][:, None]
        h = h + k[:, t][:, :, None] * delta[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", h, q[:, t]))
        states.append(h)
    return torch.stack(outs, dim=1), states


@pytest.mark.parametrize(("chunk", "cuts", "pair_bytes"), [(32, [], None), (32, [16, 45, 160], 1), (64, [1, 200], None),
                                                          (20, [45], None)])
def test_scan_matches_token_by_token_recurrence(chunk, cuts, pair_bytes, monkeypatch):
    """200 tokens, 3 heads, per-channel log decays from -0.002 to about -150 a token (cumulative
    decays that leave float32's range within a chunk, where exp(cs) exp(-cs) would overflow), a
    nonzero initial state; the taps equal the recurrence's states after those tokens. Segments
    cut short and chunks that are not whole sub-chunks are padded; ``pair_bytes`` 1 makes each
    segment a batch of its own."""
    if pair_bytes is not None:
        monkeypatch.setattr(kimi_delta, "PAIR_BYTES", pair_bytes)
    g_ = torch.Generator().manual_seed(0)
    heads, n, dim = 3, 200, 16
    q, k = (torch.nn.functional.normalize(torch.randn(heads, n, dim, generator=g_), dim=-1) for _ in range(2))
    v = torch.randn(heads, n, dim, generator=g_)
    g = -torch.exp(torch.empty(heads, n, dim).uniform_(-6, 5, generator=g_))
    beta = torch.rand(heads, n, generator=g_)
    h0 = torch.randn(heads, dim, dim, generator=g_)
    o, h, tapped = kimi_delta.kda_scan(q, k, v, g, beta, h0, chunk, cuts)
    assert torch.isfinite(o).all()
    ref, states = _oracle(q, k, v, g, beta, h0)
    assert (o.double() - ref).abs().max().item() < 1e-4
    assert (h.double() - states[-1]).abs().max().item() < 1e-4
    for cut, state in zip(cuts, tapped, strict=True):
        assert (state.double() - states[cut - 1]).abs().max().item() < 1e-4, f"tap at {cut}"


@pytest.mark.parametrize(("field", "value"), [("hidden_act", "gelu"), ("moe_router_activation_func", "softmax"),
                                              ("mla_use_nope", False)])
def test_unsupported_variants_are_refused(field, value):
    from hyprefix.models.kimi_linear import KimiLinearForCausalLM

    cfg = _config()
    setattr(cfg, field, value)
    with pytest.raises(ValueError, match=field):
        KimiLinearForCausalLM(cfg, torch.float32, torch.device("meta"), 64)
