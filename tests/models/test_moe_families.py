"""Mixture-of-experts families (``models/moe.py``, ``models/fused_moe.py``): each tiny random
model greedy-decodes as transformers does in float32, from its HF checkpoint and from the GGUF
file llama.cpp's own converter writes for it; a quantized file's expert stacks stay in their
blocks; ``--quantization int8/int4`` holds an HF checkpoint's experts as tiles; prefix hits on
and off give the same tokens, and decode steps run compiled (the experts one extern op)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hyprefix import LLM, SamplingParams
from hyprefix.kernels import quant_linear
from hyprefix.models import gguf_hybrid
from hyprefix.models.fused_moe import Experts
from hyprefix.models.loader import gguf_architecture, load_config
from tests.support.compare import hf_greedy, random_prompts
from tests.support.gguf_convert import run_converter
from tests.support.models import hub_layer_types, save_tiny_checkpoint, tiny_moe_config

# test case -> the GGUF architecture the converter writes
ARCHS = {"qwen3_moe": "qwen3moe", "granite_moe_hybrid": "granitehybrid", "granite_hybrid_dense": "granitehybrid",
         "nemotron_h_moe": "nemotron_h_moe"}
MOE_CASES = ["qwen3_moe", "granite_moe_hybrid", "nemotron_h_moe"]  # those with experts in a GGUF file
HF_ONLY = ("gpt_oss",)  # its GGUF files: test_gpt_oss_mxfp4_checkpoint_and_gguf (a GGUF cannot state the 3.0 limit)
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
needs_quant = pytest.mark.skipif(not quant_linear.available(), reason="the quant kernels do not run on this CPU")


@pytest.fixture(scope="session")
def moe_models(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    """case -> (HF checkpoint dir, HF model)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("tiny-moe")
    out = {}
    for case in (*ARCHS, *HF_ONLY):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_moe_config(case), dtype=torch.float32).eval()
        with torch.no_grad():  # HF leaves these at 1 (the correction bias at 0); vary them so a wrong index shows
            for name, p in [*model.named_parameters(), *model.named_buffers()]:
                if name.endswith(("dt_bias", ".D")) or "mamba.norm" in name or ".mixer.norm" in name:
                    p.uniform_(0.5, 1.5)
                elif name.endswith("sinks"):  # large enough to take a good share of every softmax
                    p.uniform_(1.0, 3.0)
                elif name.endswith("e_score_correction_bias") or (case == "gpt_oss" and "bias" in name):
                    p.normal_(0, 0.3)
        save_tiny_checkpoint(model, root / case)
        if case.startswith("granite"):
            hub_layer_types(root / case)
        out[case] = (root / case, model)
    return out


@pytest.fixture(scope="session")
def moe_ggufs(llama_converter, moe_models, tmp_path_factory) -> dict[tuple[str, str], Path]:
    """(case, outtype) -> the file the converter writes, f32 and q8_0, in one converter run."""
    root = tmp_path_factory.mktemp("moe-gguf")
    out = {(case, kind): root / f"{case}-{kind}.gguf" for case in ARCHS for kind in ("f32", "q8_0")}
    run_converter(llama_converter, [(["--outtype", kind, "--outfile", str(path), str(moe_models[case][0])], [])
                                    for (case, kind), path in out.items()])
    return out


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


@pytest.mark.parametrize(("case", "source"), [(c, s) for c in ARCHS for s in ("hf", "gguf")] +
                         [(c, "hf") for c in HF_ONLY])
def test_greedy_matches_transformers(moe_models, moe_ggufs, case, source):
    """float32 greedy tokens equal transformers' on the HF model, from the checkpoint and from
    the f32 GGUF; a repeated prompt hits the prefix cache and decodes the same."""
    path, hf = moe_models[case]
    model = path if source == "hf" else moe_ggufs[case, "f32"]
    llm = LLM(str(model), dtype="float32", num_kv_blocks=64, log_stats_interval=0)
    prompts = random_prompts((3, 40), seed=5)
    first = _tokens(llm, prompts)
    assert first == [hf_greedy(hf, p, PARAMS.max_tokens) for p in prompts]
    again = llm.generate([prompts[-1]], PARAMS, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == first[-1]


@pytest.mark.parametrize("case", list(ARCHS))
def test_gguf_config_and_tensors_are_transformers(moe_models, moe_ggufs, case):
    """The f32 file's config is the HF model's, and every tensor it gives is the HF model's own."""
    path, hf = moe_ggufs[case, "f32"], moe_models[case][1]
    assert gguf_architecture(path) == ARCHS[case]
    config = load_config(path)
    assert type(config) is type(hf.config) and config.architectures == [type(hf).__name__]
    for key in KEYS[case]:
        assert getattr(config, key) == pytest.approx(getattr(hf.config, key)), key
    ours, theirs = dict(gguf_hybrid.iter_tensors(path, config)), hf.state_dict()
    assert {name for name, _ in hf.named_parameters()} <= set(ours) <= set(theirs)  # buffers: the correction bias
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, theirs[name], rtol=1e-6, atol=1e-6, msg=name)


COMMON_KEYS = ("num_hidden_layers", "hidden_size", "num_experts_per_tok", "num_key_value_heads", "tie_word_embeddings")
GRANITE_KEYS = (*COMMON_KEYS, "num_local_experts", "intermediate_size", "shared_intermediate_size", "layers_block_type",
                "position_embedding_type", "embedding_multiplier", "residual_multiplier", "attention_multiplier",
                "logits_scaling", "mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_expand", "mamba_conv_bias")
KEYS = {"qwen3_moe": (*COMMON_KEYS, "num_experts", "moe_intermediate_size", "norm_topk_prob", "head_dim"),
        "granite_moe_hybrid": GRANITE_KEYS, "granite_hybrid_dense": GRANITE_KEYS,
        "nemotron_h_moe": (*COMMON_KEYS, "layers_block_type", "n_routed_experts", "moe_intermediate_size",
                           "moe_shared_expert_intermediate_size", "moe_latent_size", "n_group", "topk_group",
                           "norm_topk_prob", "routed_scaling_factor", "head_dim")}


def _experts(llm: LLM) -> list[Experts]:
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, Experts)]


@needs_quant
@pytest.mark.hybrid_graphs
@pytest.mark.parametrize("case", MOE_CASES)
def test_quantized_experts_stay_in_blocks_and_decode_compiled(moe_ggufs, case):
    """A Q8_0 file's expert stacks stay in the file's blocks (no float copy), every decode step
    runs compiled (Qwen3-MoE's in ``DecodeModel``'s one call, the hybrids' in the compiled
    graph), and prefix hits on and off give the same greedy tokens."""
    path = moe_ggufs[case, "q8_0"]
    prompts = random_prompts((3, 40), seed=7)
    cached = LLM(str(path), dtype="float32", num_kv_blocks=64, log_stats_interval=0)
    experts = _experts(cached)
    assert experts and all(e.forms.quant is not None and not e.weight.numel() for e in experts)
    first = [_tokens(cached, [p])[0] for p in prompts]  # one at a time: batch-1 steps, the graph tests compile
    steps = cached.engine.runner.decode_steps
    path_taken = "kernel" if case == "qwen3_moe" else "graph"
    assert steps["eager"] == 0 and steps[path_taken] == len(prompts) * (PARAMS.max_tokens - 1)
    again = cached.generate([prompts[-1]], PARAMS, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == first[-1]
    uncached = LLM(str(path), dtype="float32", num_kv_blocks=64, enable_prefix_caching=False, log_stats_interval=0,
                   enforce_eager=True)
    assert _tokens(uncached, prompts) == first


@needs_quant
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantization_holds_hf_experts_as_tiles(moe_models, quantization):
    """``--quantization int8/int4`` quantizes an HF checkpoint's experts into the tiles the MoE
    op multiplies (the float stacks dropped), each weight within half a step of its group's
    scale, and leaves the routers float; prefix hits on and off give the same greedy tokens."""
    path, hf = moe_models["qwen3_moe"]
    prompts = random_prompts((3, 40), seed=9)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, log_stats_interval=0, quantization=quantization)
    experts = _experts(llm)
    assert len(experts) == 2 * hf.config.num_hidden_layers
    assert all(e.forms.quant is not None and not e.weight.numel() for e in experts)
    routers = [m.router for m in llm.engine.runner.model.modules() if hasattr(m, "router")]
    assert routers and all(r.forms.quantized is None for r in routers)  # routers stay float
    stacks = [p for name, p in hf.named_parameters() if ".experts." in name]
    levels = 127 if quantization == "int8" else 15  # int8: symmetric over max |w|; int4: 16 codes over the range
    for expert, stack in zip(experts, stacks, strict=True):
        plain = stack.detach().reshape(expert.forms.rows, -1)
        error = (expert.forms.quant.dequantize(torch.float32) - plain).abs().unflatten(1, (-1, 32)).amax(-1)
        spread = plain.abs().unflatten(1, (-1, 32)).amax(-1) * (1 if quantization == "int8" else 2)
        assert (error <= spread / levels * 0.51 + 1e-3).all()
    first = _tokens(llm, prompts)
    uncached = LLM(str(path), dtype="float32", num_kv_blocks=64, enable_prefix_caching=False, log_stats_interval=0,
                   quantization=quantization)
    assert _tokens(uncached, prompts) == first


def test_sigmoid_group_routing_is_transformers():
    """Sigmoid routing over expert groups (Nemotron 3, DeepSeek-V3's scheme: the correction bias
    ranks, the two best of each group rank the groups, the scores weigh) chooses and weighs as
    transformers' NemotronH router, with more than one group kept of several."""
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHTopkRouter

    from hyprefix.models.moe import Routing

    config = NemotronHConfig(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                             norm_topk_prob=True, routed_scaling_factor=2.5)
    router = NemotronHTopkRouter(config)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 32, generator=gen))
        router.e_score_correction_bias.copy_(torch.randn(16, generator=gen) * 0.3)
    x = torch.randn(50, 32, generator=gen)
    _, theirs_weights, theirs_chosen = router(x)
    routing = Routing(4, True, scoring="sigmoid", groups=4, groups_kept=2, scale=2.5)
    weights, chosen = routing(x @ router.weight.T, torch.float32, router.e_score_correction_bias)
    ours = torch.zeros(50, 16).scatter_(1, chosen, weights)
    torch.testing.assert_close(ours, torch.zeros(50, 16).scatter_(1, theirs_chosen, theirs_weights))
    assert all(len(set((row // 4).tolist())) <= 2 for row in chosen)  # from two groups of four at most


def _gpt_oss_stacks(experts) -> tuple[torch.Tensor, ...]:
    """transformers' GptOssExperts ([E, H, 2I] with gate and up columns interleaved, [E, I, H])
    in the experts op's layout: [E, 2I, H] gate rows then up rows, [E, H, I], biases to match."""
    gate_up, bias = experts.gate_up_proj.detach().transpose(1, 2), experts.gate_up_proj_bias.detach()
    gate_up = torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1)
    bias = torch.cat([bias[:, 0::2], bias[:, 1::2]], dim=1)
    return gate_up, bias, experts.down_proj.detach().transpose(1, 2), experts.down_proj_bias.detach()


@pytest.mark.parametrize("quantized,tokens", [(None, 9), ("int8", 9), ("mxfp4", 9), ("mxfp4", 1), ("int8", 2)])
def test_clamped_swiglu_experts_with_biases_are_gpt_oss(quantized, tokens):
    """gpt-oss's experts (clamped SwiGLU, a bias on each projection) in the float op and on int8
    or MX4 tiles in ``quant_moe``: equal to transformers' GptOssExperts on the same weights (the tiles'
    dequantized weights, and the activations rounded as the kernel rounds them), at decode's one and
    two tokens as at a prefill's nine."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from hyprefix.models.fused_moe import ExpertActivation, activate, moe_experts
    from hyprefix.models.quant import QuantTiles, int8_part, quantize_activations, quantize_int8, quantize_mxfp4

    if quantized and not quant_linear.available():
        pytest.skip("the quant kernels do not run on this CPU")
    config = GptOssConfig(hidden_size=64, intermediate_size=32, num_local_experts=6, swiglu_limit=2.0)
    reference = GptOssExperts(config)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    x = torch.randn(tokens, 64, generator=gen)
    chosen = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, 2, generator=gen), dim=-1)
    gate_up, up_bias, down, down_bias = _gpt_oss_stacks(reference)
    act = ExpertActivation("swiglu_oai", config.swiglu_alpha, config.swiglu_limit)
    if not quantized:
        ours = moe_experts(x, chosen, weights, gate_up, down, act.name, up_bias, down_bias, act.alpha, act.limit)
        torch.testing.assert_close(ours, reference(x, chosen, weights), rtol=1e-5, atol=1e-5)
        return
    tiles = [int8_part(quantize_int8(w.reshape(-1, w.shape[-1]), group=32)) if quantized == "int8" else
             quantize_mxfp4(w.reshape(-1, w.shape[-1])) for w in (gate_up, down)]
    ours = quant_linear.quant_moe(x, chosen, weights, tiles[0], 64, tiles[1], 64, act.name, up_bias, down_bias,
                                  act.alpha, act.limit)
    with torch.no_grad():  # the reference on the tiles' weights, activations rounded per 32 as the kernel does
        deq = [QuantTiles(part, 6 * 64, w.shape[-1]).dequantize(torch.float32)
               for part, w in zip(tiles, (gate_up, down), strict=True)]
        expected = torch.zeros_like(x)
        for t in range(tokens):
            for slot in range(2):
                e = int(chosen[t, slot])
                h = activate(quantize_activations(x[t:t + 1]) @ deq[0][e * 64:(e + 1) * 64].T + up_bias[e], act)
                h = quantize_activations(h) @ deq[1][e * 64:(e + 1) * 64].T + down_bias[e]
                expected[t] += weights[t, slot] * h[0]
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)
    if quantized == "int8":
        assert (reference(x, chosen, weights) - ours).abs().max() < 0.2  # and near the float experts


def test_gpt_oss_hits_across_its_window(moe_models):
    """gpt-oss (sinks, a 16-token window on every other layer): a conversation's later turns hit
    the prefix cache far past the window, with prompts chunked across steps and the sliding
    layers in their own pool; the tokens equal transformers' and those of an engine without the
    cache (sinks counted once however the keys were split between cache and step)."""
    path, hf = moe_models["gpt_oss"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    kwargs = dict(dtype="float32", num_kv_blocks=96, log_stats_interval=0, max_num_batched_tokens=24)
    cached, plain = LLM(str(path), **kwargs), LLM(str(path), **kwargs, enable_prefix_caching=False)
    prompt = random_prompts((50,), seed=13)[0]
    for turn in range(3):
        out = cached.generate([prompt], params, use_tqdm=False)[0]
        tokens = out.outputs[0].token_ids
        assert tokens == plain.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        assert tokens == hf_greedy(hf, prompt, params.max_tokens)
        if turn:  # every full 16-token block of the earlier turns (48 of 67, 64 of 84): far past the window
            assert out.num_cached_tokens >= len(prompt) - 20
        prompt = [*prompt, *tokens, *random_prompts((9,), seed=20 + turn)[0]]


def test_gpt_oss_sinks_through_the_cascade(moe_models):
    """Decodes that share a prefix read it once (the cascade: segments merged by log-sum-exp, the
    sink applied after the merge) and give the tokens of an engine that reads every row whole."""
    from tests.support.models import TINY_CASCADE

    path, _ = moe_models["gpt_oss"]
    shared = random_prompts((40,), seed=17)[0]
    prompts = [[*shared, *random_prompts((5,), seed=30 + i)[0]] for i in range(4)]
    kwargs = dict(dtype="float32", num_kv_blocks=96, log_stats_interval=0)
    cascade = LLM(str(path), **kwargs, **TINY_CASCADE, enforce_eager=True)
    model = cascade.engine.runner.model
    forward, plans = model.forward, []
    model.forward = lambda batch, *rest: plans.append(batch.decode_cascade) or forward(batch, *rest)
    plain = LLM(str(path), **kwargs, enable_prefix_caching=False)
    assert _tokens(cascade, prompts) == _tokens(plain, prompts)
    assert any(g.rows.numel() == 4 for plan in plans if plan is not None for g in plan.segments)


@pytest.mark.window_graphs
@pytest.mark.parametrize("window_pool", [True, False])
def test_gpt_oss_decodes_through_the_graph(moe_models, window_pool):
    """Every decode step of gpt-oss runs compiled (the experts and the sinks inside the graph),
    its window layers' K/V in their own pool (their tables, slots and first positions inputs of
    the graph; contexts past the 16-token window) or in the main pool
    (``disable_hybrid_swa_memory``), with transformers' tokens."""
    path, hf = moe_models["gpt_oss"]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, log_stats_interval=0,
              disable_hybrid_swa_memory=not window_pool)
    assert llm.engine.runner.has_window_pool == window_pool
    for prompt in random_prompts((3, 40), seed=5):
        assert _tokens(llm, [prompt])[0] == hf_greedy(hf, prompt, PARAMS.max_tokens)
    steps = llm.engine.runner.decode_steps
    assert steps["eager"] == 0 and steps["graph"] == 2 * (PARAMS.max_tokens - 1)


@pytest.fixture(scope="session")
def gpt_oss_mxfp4(llama_converter, tmp_path_factory) -> tuple[Path, Path, object]:
    """(the hub-style MXFP4 checkpoint, the GGUF llama.cpp's converter writes of it, the HF model
    holding the MXFP4 values as floats). The SwiGLU limit is gpt-oss's 7.0: a GGUF file does not
    state it (the HF cases clamp at 3.0)."""
    from transformers import AutoModelForCausalLM

    from tests.support.models import save_mxfp4_checkpoint

    root = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    config = tiny_moe_config("gpt_oss")
    config.swiglu_limit = 7.0
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("sinks"):
                p.uniform_(1.0, 3.0)
            elif "bias" in name:
                p.normal_(0, 0.3)
    save_mxfp4_checkpoint(hf, root / "hf")
    args = ["--outtype", "f32", "--outfile", str(root / "mxfp4.gguf"), str(root / "hf")]
    run_converter(llama_converter, [(args, [])])
    return root / "hf", root / "mxfp4.gguf", hf


def test_gpt_oss_mxfp4_checkpoint_and_gguf(gpt_oss_mxfp4):
    """The hub's MXFP4 checkpoint and llama.cpp's GGUF of it: read as floats, greedy tokens equal
    transformers'; by default every expert stack stays MXFP4 (MX4 tiles, 4.25 bits a weight, as
    on disk), and both sources then give the same tokens (the same tiles, the same arithmetic)."""
    from hyprefix.models.quant import part_format

    checkpoint, gguf_file, hf = gpt_oss_mxfp4
    assert gguf_architecture(gguf_file) == "gpt-oss"
    prompts = random_prompts((3, 40), seed=5)
    expected = [hf_greedy(hf, p, PARAMS.max_tokens) for p in prompts]
    tiled = []
    for path in (checkpoint, gguf_file):
        floats = LLM(str(path), dtype="float32", num_kv_blocks=64, log_stats_interval=0, quantization="none")
        assert _tokens(floats, prompts) == expected
        if not quant_linear.available():
            continue
        llm = LLM(str(path), dtype="float32", num_kv_blocks=64, log_stats_interval=0)
        experts = _experts(llm)
        assert len(experts) == 2 * hf.config.num_hidden_layers
        for e in experts:
            assert part_format(e.forms.quant.tensors) == "mxfp4" and not e.weight.numel()
            assert e.forms.quant.nbytes * 8 == e.forms.rows * e.forms.cols * 4.25
        tiled.append(_tokens(llm, prompts))
    if tiled:
        assert tiled[0] == tiled[1]


@needs_quant
@pytest.mark.window_graphs
def test_gpt_oss_mxfp4_cache_on_and_off_and_compiled(gpt_oss_mxfp4):
    """MX4 experts: prefix hits on and off give the same greedy tokens, and every batch-1 decode
    step runs compiled (the MX4 experts one extern op), as eager steps do."""
    _, gguf_file, _ = gpt_oss_mxfp4
    prompts = random_prompts((3, 40), seed=7)
    kwargs = dict(dtype="float32", num_kv_blocks=64, log_stats_interval=0)
    cached = LLM(str(gguf_file), **kwargs)
    first = [_tokens(cached, [p])[0] for p in prompts]
    steps = cached.engine.runner.decode_steps
    assert steps["eager"] == 0 and steps["graph"] == len(prompts) * (PARAMS.max_tokens - 1)
    again = cached.generate([prompts[-1]], PARAMS, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == first[-1]
    assert _tokens(LLM(str(gguf_file), **kwargs, enable_prefix_caching=False, enforce_eager=True), prompts) == first
