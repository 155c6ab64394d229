"""DeepSeek-V2 / V2-Lite / V3 (``models/deepseek.py``): multi-head latent attention over a
latent cache (a block holds each token's latent once) and MoE with shared experts. Tiny random
models greedy-decode as transformers does in float32, from their HF checkpoints and from the
``deepseek2`` GGUF files llama.cpp's own converter writes; prefix hits on and off give the same
tokens when a prompt longer than the step's token budget follows a cached prefix (the case vLLM
got wrong, issue 26042: chunks of a prompt attend over the cached latent and over earlier chunks)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hyprefix import LLM, SamplingParams
from hyprefix.kernels import quant_linear
from hyprefix.models import deepseek, mla_prefill
from hyprefix.models.fused_moe import Experts
from tests.support.compare import hf_greedy, random_prompts
from tests.support.gguf_convert import run_converter
from tests.support.models import save_tiny_checkpoint, tiny_moe_config

CASES = ("deepseek_v2_lite", "deepseek_v2", "deepseek_v3")
PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="session")
def deepseek_models(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    """case -> (HF checkpoint dir, HF model)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("tiny-deepseek")
    out = {}
    for case in CASES:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_moe_config(case), dtype=torch.float32).eval()
        with torch.no_grad():  # HF leaves the correction bias at 0: vary it so a wrong index shows
            for name, p in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    p.normal_(0, 0.3)
        save_tiny_checkpoint(model, root / case)
        out[case] = (root / case, model)
    return out


@pytest.fixture(scope="session")
def deepseek_ggufs(llama_converter, deepseek_models, tmp_path_factory) -> dict[tuple[str, str], Path]:
    """(case, outtype) -> the ``deepseek2`` file llama.cpp's converter writes, f32 and q8_0. V3's
    checkpoint gets the hub config's ``scoring_func`` / ``topk_method`` (transformers' config does
    not save them), from which the converter writes sigmoid gating."""
    root = tmp_path_factory.mktemp("deepseek-gguf")
    out = {(case, kind): root / f"{case}-{kind}.gguf" for case in CASES for kind in ("f32", "q8_0")}
    hub_keys = {"deepseek_v3": {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}}
    run_converter(llama_converter, [(["--outtype", kind, "--outfile", str(path), str(deepseek_models[case][0])], [],
                                     hub_keys.get(case, {})) for (case, kind), path in out.items()])
    return out


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


@pytest.mark.parametrize(("case", "source"), [(c, s) for c in CASES for s in ("hf", "gguf")])
def test_greedy_matches_transformers(deepseek_models, deepseek_ggufs, case, source):
    """float32 greedy tokens equal transformers', from the checkpoint and from the f32 GGUF; a
    block of the cache holds the latent alone (kv_lora_rank + rope dims a token and layer, counted
    once)."""
    path, hf = deepseek_models[case]
    path = path if source == "hf" else deepseek_ggufs[case, "f32"]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, log_stats_interval=0)
    assert type(llm.engine.runner.model).__name__ == hf.config.architectures[0]
    prompts = random_prompts((3, 40, 21), seed=5)
    assert _tokens(llm, prompts) == [hf_greedy(hf, p, PARAMS.max_tokens) for p in prompts]
    runner = llm.engine.runner
    cfg = hf.config
    latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    assert runner.kv_bytes_per_block(runner.model, torch.float32, 1) == cfg.num_hidden_layers * latent * 4
    k, v = runner.kv_caches[0]
    assert v is k and k.shape[2:] == (1, latent)


@pytest.mark.parametrize("case", ["deepseek_v2_lite", "deepseek_v3"])
@pytest.mark.parametrize("prefill", ["by cost", "up-projected"])
def test_chunked_prompts_over_a_cached_prefix(deepseek_models, case, prefill, monkeypatch):
    """Prompts of 30-70 new tokens after a cached 48-token prefix, with 16 tokens a step: hits on
    and off, and transformers, give the same greedy tokens, with the prefill chunks chosen by
    cost (at these tiny widths: absorbed) or every one up-projected (its context's latents,
    prefix gathered from the cache, multiplied out into per-head keys and values)."""
    calls = []
    if prefill == "up-projected":
        monkeypatch.setattr(mla_prefill, "UP_PROJECTED_WEIGHT", 0.0)
        real = deepseek.up_projected_attention
        monkeypatch.setattr(deepseek, "up_projected_attention", lambda *a: calls.append(a[-1]) or real(*a))
    path, hf = deepseek_models[case]
    shared = random_prompts((48,), seed=11)[0]
    prompts = [[*shared, *tail] for tail in random_prompts((30, 70, 45), seed=12)]
    kwargs = dict(dtype="float32", num_kv_blocks=96, log_stats_interval=0, max_num_batched_tokens=16)
    cached, plain = LLM(str(path), **kwargs), LLM(str(path), **kwargs, enable_prefix_caching=False)
    cached.generate([shared], SamplingParams(max_tokens=1), use_tqdm=False)
    outs = cached.generate(prompts, PARAMS, use_tqdm=False)
    assert all(o.num_cached_tokens >= 32 for o in outs)
    tokens = [o.outputs[0].token_ids for o in outs]
    assert tokens == _tokens(plain, prompts)
    assert tokens == [hf_greedy(hf, p, PARAMS.max_tokens) for p in prompts]
    if prefill == "up-projected":  # spans over a cached prefix and fresh ones both went that way
        assert any(span.start_pos > 0 for span in calls) and any(span.start_pos == 0 for span in calls)


def test_prefill_chooses_by_cost_at_deepseek_widths():
    """At DeepSeek's widths (rank 512, rope 64, nope 128, values 128) a fresh 512-token chunk, or
    one over a prefix as long, is up-projected; a short chunk over a long cached prefix stays
    absorbed (making every prefix token's keys would cost more than the wider attention)."""
    attn = SimpleNamespace(rank=512, rope_dim=64, nope=128, v_dim=128)
    batch = SimpleNamespace(batch_invariant=False, prefills=[
        SimpleNamespace(num_tokens=512, context_len=512), SimpleNamespace(num_tokens=512, context_len=1024),
        SimpleNamespace(num_tokens=16, context_len=1040), SimpleNamespace(num_tokens=64, context_len=2112)])
    assert mla_prefill.up_projected_spans(attn, batch) == {0, 1}
    batch.batch_invariant = True
    assert mla_prefill.up_projected_spans(attn, batch) == set()


@pytest.mark.skipif(not quant_linear.available(), reason="the quant kernels do not run on this CPU")
def test_q8_0_file_keeps_its_blocks_and_caches_the_latent(deepseek_ggufs):
    """A Q8_0 ``deepseek2`` file: the expert stacks, the attention's projections and its per-head
    W_UK / W_UV stacks (``attn_k_b`` / ``attn_v_b``) stay in the file's blocks, and prefix hits on
    and off give the same greedy tokens."""
    path = deepseek_ggufs["deepseek_v2", "q8_0"]
    kwargs = dict(dtype="float32", num_kv_blocks=64, log_stats_interval=0)
    cached = LLM(str(path), **kwargs)
    model = cached.engine.runner.model
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    assert experts and all(e.forms.quant is not None and not e.weight.numel() for e in experts)
    assert all(stack in experts for layer in model.layers for stack in (layer.attn.w_uk, layer.attn.w_uv))
    assert all(layer.attn.kv_a.forms.quantized is not None for layer in model.layers)
    prompts = random_prompts((3, 40), seed=7)
    first = _tokens(cached, prompts)
    again = cached.generate([prompts[-1]], PARAMS, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == first[-1]
    assert _tokens(LLM(str(path), **kwargs, enable_prefix_caching=False), prompts) == first


def test_latent_blocks_go_to_disk_once_and_come_back(deepseek_models, tmp_path):
    """The disk tier writes a latent block once (its bytes: the latent of every layer, not K and
    V), and a new engine over the directory hits the prompt from disk with the same tokens;
    ``model_facts`` reports the latent's bytes a token."""
    path, hf = deepseek_models["deepseek_v2"]
    cfg = hf.config
    latent_bytes = cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    prompt = random_prompts((80,), seed=21)[0]
    kwargs = dict(dtype="float32", num_kv_blocks=64, log_stats_interval=0, disk_cache_dir=str(tmp_path / "disk"))
    first = LLM(str(path), **kwargs)
    assert first.engine.model_facts.kv_bytes_per_token == latent_bytes
    assert first.engine.disk.io.kv_block_bytes == 16 * latent_bytes
    tokens = _tokens(first, [prompt])[0]
    first.engine.close()
    second = LLM(str(path), **kwargs)
    out = second.generate([prompt], PARAMS, use_tqdm=False)[0]
    assert out.num_cached_tokens >= 64 and out.outputs[0].token_ids == tokens
    assert second.get_stats()["disk_cache_hit_tokens"] >= 64
