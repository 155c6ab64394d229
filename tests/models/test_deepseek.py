"""DeepSeek-V2 / V2-Lite / V3 (``models/deepseek.py``): multi-head latent attention over a
latent cache (a block holds each token's latent once) and MoE with shared experts. Tiny random
models greedy-decode as transformers does in float32, from their HF checkpoints and from the
``deepseek2`` GGUF files llama.cpp's own converter writes; prefix hits on and off give the same
tokens when a prompt longer than the step's token budget follows a cached prefix (the case vLLM
got wrong, issue 26042: chunks of a prompt attend over the cached latent and over earlier chunks).
The 8-bit latent cache (``--kv-cache-dtype int8 | fp8_e4m3``) is the model-dtype cache over latents
rounded through its format, near it in logprobs, ~2x the blocks a GiB of bfloat16, through the
disk tier and under hits and chunking up to near ties."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hyprefix import LLM, SamplingParams
from hyprefix.kernels import quant_linear
from hyprefix.models import deepseek, kv_quant, mla_prefill
from hyprefix.models.fused_moe import Experts
from tests.support.compare import (
    assert_first_step_near,
    assert_same_up_to_a_near_tie,
    generate_in_waves,
    hf_greedy,
    random_prompts,
)
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


FORMATS = ("int8", "fp8_e4m3")
STORAGE = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}


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


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8_e4m3"])
def test_latent_blocks_go_to_disk_once_and_come_back(deepseek_models, tmp_path, kv_cache_dtype):
    """The disk tier writes a latent block once (its bytes: the latent of every layer, not K and
    V; an 8-bit cache's packed rows, codes and scale), and a new engine over the directory hits
    the prompt from disk with the same tokens (an 8-bit cache's up to a near tie: the hit's
    chunk rounds differently, and a code of a later layer can flip); ``model_facts`` reports the
    latent's bytes a token. An engine of another K/V format finds none of those blocks."""
    path, hf = deepseek_models["deepseek_v2"]
    cfg = hf.config
    latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    latent_bytes = cfg.num_hidden_layers * (latent * 4 if kv_cache_dtype == "auto" else latent + 2)
    prompt = random_prompts((80,), seed=21)[0]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    kwargs = dict(dtype="float32", num_kv_blocks=64, log_stats_interval=0, disk_cache_dir=str(tmp_path / "disk"))
    first = LLM(str(path), kv_cache_dtype=kv_cache_dtype, **kwargs)
    assert first.engine.model_facts.kv_bytes_per_token == latent_bytes
    assert first.engine.disk.io.kv_block_bytes == 16 * latent_bytes
    ref = first.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    first.engine.close()
    second = LLM(str(path), kv_cache_dtype=kv_cache_dtype, **kwargs)
    out = second.generate([prompt], params, use_tqdm=False)[0]
    assert out.num_cached_tokens >= 64 and second.get_stats()["disk_cache_hit_tokens"] >= 64
    if kv_cache_dtype == "auto":
        assert out.outputs[0].token_ids == ref.token_ids
    else:
        assert_same_up_to_a_near_tie(ref, out.outputs[0], 0.02)
        second.engine.close()
        other = LLM(str(path), kv_cache_dtype="int8" if kv_cache_dtype != "int8" else "fp8_e4m3", **kwargs)
        assert other.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens == 0


# --kv-cache-dtype int8 | fp8_e4m3 on the latent cache (deepseek.py: its rows rotated per part)


@pytest.fixture(scope="module")
def one_layer_deepseek(tmp_path_factory) -> Path:
    """A one-layer DeepSeek-V2 (a dense MLP): no later layer whose latents a flipped code moves."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_moe_config("deepseek_v2")
    cfg.num_hidden_layers = 1
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("one-layer-deepseek") / "ds"
    save_tiny_checkpoint(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval(), path)
    return path


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_8bit_latent_cache_is_the_auto_cache_over_rounded_latents(one_layer_deepseek, kv_cache_dtype, monkeypatch):
    """The 8-bit latent cache (prompts whole and in chunks of 16, absorbed and up-projected) gives
    the logprobs of the model-dtype cache whose latents were rounded through the format first
    (rotated per part, quantized, dequantized, turned back), eager both: the rotation, the packed
    reads and the turning back add nothing but float32 rounding. With its decode steps compiled
    (the batch-1 graph; its latents computed by Inductor's loops, so a code can flip), the same
    up to a near tie."""
    prompts = random_prompts((40, 70, 21), seed=5)
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=5, ignore_eos=True)
    kwargs = dict(dtype="float32", num_kv_blocks=64, log_stats_interval=0)
    write = deepseek.LatentAttention._write

    def rounded(self, latent, cache, batch):
        packed = kv_quant.quantize_rows(self.rotated(latent.float()), STORAGE[kv_cache_dtype])
        return write(self, self.unrotated(kv_quant.dequantize_rows(packed, torch.float32)), cache, batch)

    def outputs(**more) -> list:
        return [o.outputs[0] for o in LLM(str(one_layer_deepseek), **kwargs, **more).generate(
            prompts, params, use_tqdm=False)]

    with monkeypatch.context() as patch:
        patch.setattr(deepseek.LatentAttention, "_write", rounded)
        ref = outputs(enforce_eager=True)
    for chunks, weight in (({}, mla_prefill.UP_PROJECTED_WEIGHT), ({"max_num_batched_tokens": 16}, 0.0)):
        monkeypatch.setattr(mla_prefill, "UP_PROJECTED_WEIGHT", weight)
        for a, b in zip(ref, outputs(kv_cache_dtype=kv_cache_dtype, enforce_eager=True, **chunks), strict=True):
            assert a.token_ids == b.token_ids
            for la, lb in zip(a.logprobs, b.logprobs, strict=True):
                assert max(abs(la[t].logprob - lb[t].logprob) for t in la.keys() & lb.keys()) < 1e-4
    monkeypatch.setattr(mla_prefill, "UP_PROJECTED_WEIGHT", mla_prefill.UP_PROJECTED_WEIGHT)
    llm = LLM(str(one_layer_deepseek), kv_cache_dtype=kv_cache_dtype, **kwargs)
    for a, prompt in zip(ref, prompts, strict=True):  # one at a time: the batch-1 graph
        assert_same_up_to_a_near_tie(a, llm.generate([prompt], params, use_tqdm=False)[0].outputs[0], 0.02)
    assert llm.engine.runner.decode_steps["graph"] > 0 and llm.engine.runner.decode_steps["eager"] == 0


def test_the_latent_rotation_keeps_scores_and_turns_back():
    """blockdiag(R_r, R_p): a query's dot products with latents unchanged, a latent's first r values
    a rotation of c alone (k_pe mixed into no value), ``unrotated`` the inverse."""
    attn = SimpleNamespace(rank=32, rope_dim=16)
    rotated = lambda x: deepseek.LatentAttention.rotated(attn, x)  # noqa: E731
    unrotated = lambda x: deepseek.LatentAttention.unrotated(attn, x)  # noqa: E731
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 48, generator=gen), torch.randn(7, 48, generator=gen)
    torch.testing.assert_close(rotated(q) @ rotated(k).T, q @ k.T, rtol=1e-5, atol=1e-5)
    moved = k.clone()
    moved[:, 32:] += 1
    assert torch.equal(rotated(moved)[:, :32], rotated(k)[:, :32])
    torch.testing.assert_close(unrotated(rotated(k)), k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(unrotated(rotated(k)[:, :32]), k[:, :32], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_8bit_latent_logprobs_near_the_auto_cache(deepseek_models, kv_cache_dtype):
    """Teacher-forced next-token distributions with the 8-bit latent cache against the float32
    cache's, by KL divergence over the top logprobs (test_kv_cache_dtype's bound), and the same
    first greedy token but at a near tie."""
    path, _ = deepseek_models["deepseek_v3"]
    prompts = random_prompts([40, 70, 100], seed=5)
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=20)
    outs = {}
    for fmt in ("auto", kv_cache_dtype):
        llm = LLM(str(path), dtype="float32", kv_cache_dtype=fmt, num_kv_blocks=64, log_stats_interval=0)
        outs[fmt] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    for ref, got in zip(outs["auto"], outs[kv_cache_dtype], strict=True):
        assert_first_step_near(ref, got)  # fp8's 3-bit mantissas move a random model's logprobs ~0.1


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_8bit_latent_hits_and_chunking_change_nothing_but_near_ties(deepseek_models, kv_cache_dtype, monkeypatch):
    """Prefix hits, cascade prefixes and chunked prefills (absorbed, or up-projected over the
    gathered, dequantized prefix) read the stored codes as one whole prefill does; the greedy
    tokens are the cache-off engine's up to a near tie (test_kv_cache_dtype's approach)."""
    from tests.engine.test_prefix_cache_engine import mixed_prompts
    from tests.support.models import TINY_CASCADE

    path, _ = deepseek_models["deepseek_v2_lite"]
    prompts = mixed_prompts(16)[:5]  # a prefix, two prompts parting from it, a duplicate, a full hit
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    kwargs = dict(dtype="float32", num_kv_blocks=256, kv_cache_dtype=kv_cache_dtype, log_stats_interval=0,
                  enforce_eager=True, **TINY_CASCADE)

    def run(llm: LLM, waves: int) -> list:
        return generate_in_waves(llm, prompts, params, waves)

    reference = run(LLM(str(path), enable_prefix_caching=False, **kwargs), 1)
    for waves, budget, weight in ((2, 24, mla_prefill.UP_PROJECTED_WEIGHT), (1, 10, 0.0)):
        monkeypatch.setattr(mla_prefill, "UP_PROJECTED_WEIGHT", weight)
        llm = LLM(str(path), max_num_batched_tokens=budget, **kwargs)
        for ref, got in zip(reference, run(llm, waves), strict=True):
            assert_same_up_to_a_near_tie(ref, got, 0.02)
        assert llm.get_stats()["prefix_cache_hits"] > 0


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_8bit_latent_blocks_per_gib(deepseek_models, kv_cache_dtype):
    """The same budget holds ~2x the latent blocks of bfloat16 (r + p + 2 bytes a token and layer
    against 2 (r + p)), in one tensor a layer of rows r + p + 2 wide, its V its K."""
    path, hf = deepseek_models["deepseek_v2"]
    cfg = hf.config
    latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    kwargs = dict(dtype="bfloat16", kv_cache_memory_gb=0.01, log_stats_interval=0, enforce_eager=True)
    plain, packed = LLM(str(path), **kwargs), LLM(str(path), kv_cache_dtype=kv_cache_dtype, **kwargs)
    ratio = packed.engine.max_pool_tokens / plain.engine.max_pool_tokens
    assert ratio == pytest.approx(2 * latent / (latent + 2), rel=0.02)
    runner = packed.engine.runner
    k, v = runner.kv_caches[0]
    assert v is k and k.dtype == STORAGE[kv_cache_dtype] and k.shape[2:] == (1, latent + 2)
    assert runner.kv_bytes_per_block(runner.model, k.dtype, 1) == cfg.num_hidden_layers * (latent + 2)
    assert packed.get_stats()["kv_blocks_per_gib"] / plain.get_stats()["kv_blocks_per_gib"] == pytest.approx(
        2 * latent / (latent + 2))
