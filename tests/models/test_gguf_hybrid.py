"""Hybrid GGUF files written by llama.cpp's own converter load and run (``gguf_hybrid``):
Qwen3.5 dense and MoE, Qwen3-Next, NemotronH and Mamba2.

The converter (``convert_hf_to_gguf.py`` with its ``conversion`` package and its own
``gguf-py``, which knows these architectures where the pip ``gguf`` may not) comes from the
llama-cpp-python sdist on PyPI, as CI gets it, and is kept under the test-model cache
(``$HYPREFIX_TEST_MODELS``, by default ``~/.cache/hyprefix/models``). It converts the tiny float32 HF
checkpoints to f32 GGUF files; our loader must give back transformers' exact tensors and
config, so the engine's greedy tokens equal transformers' on the original model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hyprefix import LLM, SamplingParams
from hyprefix.models import gguf_hybrid
from hyprefix.models.loader import gguf_architecture, load_config, load_tokenizer
from tests.support.compare import hf_greedy, random_prompts
from tests.support.gguf_convert import run_converter
from tests.support.models import _tiny_hybrid_config, save_tiny_checkpoint, vary_deltanet_weights

# test case -> (its tiny checkpoint, the GGUF architecture the converter writes for it)
ARCHS = {"qwen3_5": ("qwen3_5", "qwen35"), "qwen3_5_moe": ("qwen3_5_moe", "qwen35moe"),
         "qwen3_next": ("qwen3_next", "qwen3next"), "nemotron_h": ("nemotron_h", "nemotron_h_moe"),
         "nemotron_h_dense": ("nemotron_h", "nemotron_h"), "mamba2": ("mamba2", "mamba2")}
# The converter's Qwen3-Next / Qwen3.5 classes export a multi-token-prediction block unless told not to.
FLAGS = {"qwen3_5": ["--no-mtp"], "qwen3_5_moe": ["--no-mtp"], "qwen3_next": ["--no-mtp"]}
# Config keys the converter is not shown. transformers 5 saves num_experts_per_tok into every
# NemotronH config, which sends the converter down its MoE path (nemotron_h_moe, here without
# expert layers); hidden, it takes the dense path (nemotron_h), as for a config from the hub.
HIDDEN = {"nemotron_h_dense": ["num_experts_per_tok"]}

def _build(config, out: Path):
    """A tiny float32 checkpoint of ``config`` (seeded; the DeltaNet weights varied as the
    shared builder varies them), saved with the project's tokenizer."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    vary_deltanet_weights(model)
    save_tiny_checkpoint(model, out)
    return model


@pytest.fixture(scope="session")
def checkpoints(hybrid_models, tmp_path_factory) -> dict[str, tuple[Path, object]]:
    """arch -> (HF checkpoint dir, HF model). Qwen3-Next: the shared tiny one but with every
    layer MoE and normalised top-k weights, as real Qwen3-Next is (the converter has no name for
    a dense Qwen3-Next MLP, and llama.cpp normalises the top-k weights unconditionally, so a
    GGUF cannot say otherwise). Qwen3.5 MoE: the tiny Qwen3.5 with experts on every layer."""
    from transformers import Qwen3_5MoeTextConfig

    root = tmp_path_factory.mktemp("gguf-hybrid-hf")
    nxt = _tiny_hybrid_config("qwen3_next")
    nxt.mlp_only_layers, nxt.norm_topk_prob = [], True
    dense = _tiny_hybrid_config("qwen3_5").to_dict()
    skip = {"model_type", "architectures", "transformers_version", "intermediate_size", "dtype"}
    moe = Qwen3_5MoeTextConfig(**{k: v for k, v in dense.items() if k not in skip}, num_experts=8,
                               num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    return {"qwen3_5": hybrid_models["qwen3_5"], "nemotron_h": hybrid_models["nemotron_h"],
            "mamba2": hybrid_models["mamba2"],
            "qwen3_next": (root / "qwen3_next", _build(nxt, root / "qwen3_next")),
            "qwen3_5_moe": (root / "qwen3_5_moe", _build(moe, root / "qwen3_5_moe"))}


@pytest.fixture(scope="session")
def ggufs(llama_converter, checkpoints, tmp_path_factory) -> dict[str, Path]:
    """test case (``ARCHS``) -> the GGUF file llama.cpp's converter writes for its checkpoint (f32)."""
    return _convert(llama_converter, checkpoints, tmp_path_factory.mktemp("gguf-hybrid"), list(ARCHS), "f32")


def _convert(converter: Path, checkpoints, root: Path, cases: list[str], outtype: str) -> dict[str, Path]:
    """test case -> the GGUF file (``outtype``) llama.cpp's converter writes for its checkpoint,
    every case in one converter run."""
    out = {case: root / f"{case}-{outtype}.gguf" for case in cases}
    jobs = [(["--outtype", outtype, "--outfile", str(out[case]), *FLAGS.get(case, []),
              str(checkpoints[ARCHS[case][0]][0])], HIDDEN.get(case, [])) for case in cases]
    run_converter(converter, jobs)
    return out


@pytest.mark.parametrize("case", list(ARCHS))
def test_config_and_tensors_are_transformers(ggufs, checkpoints, case):
    """Every tensor the file gives is the HF model's own, under its name, and every HF
    parameter is given: each converter transform is undone exactly."""
    arch, gguf_arch = ARCHS[case]
    path, hf = ggufs[case], checkpoints[arch][1]
    assert gguf_architecture(path) == gguf_arch
    config = load_config(path)
    assert type(config) is type(hf.config) and config.architectures == [type(hf).__name__]
    for key in ("layer_types", "num_hidden_layers", "hidden_size", "vocab_size", "tie_word_embeddings"):
        assert getattr(config, key, None) == getattr(hf.config, key, None), key
    ours = dict(gguf_hybrid.iter_tensors(path, config))
    theirs = hf.state_dict()
    assert set(ours) <= set(theirs)
    assert {name for name, _ in hf.named_parameters()} <= set(ours)  # tied heads count once
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, theirs[name], rtol=1e-6, atol=1e-6, msg=f"{case}: {name}")


@pytest.mark.parametrize("case", list(ARCHS))
def test_greedy_matches_hf_generate(ggufs, checkpoints, case):
    """The engine on the GGUF file greedy-decodes as transformers does on the HF model, and a
    repeated prompt hits the prefix cache (the hybrid cache keys on the file's identity)."""
    path, hf = ggufs[case], checkpoints[ARCHS[case][0]][1]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, log_stats_interval=0)
    prompts = random_prompts((3, 40), seed=5)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 12), f"{case} prompt len {len(prompt)}"
    again = llm.generate([prompts[-1]], params, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == outs[-1].outputs[0].token_ids


def test_a_bf16_file_runs_in_bf16(llama_converter, checkpoints, tmp_path):
    """A file written with ``--outtype bf16`` declares bfloat16: ``dtype="auto"`` starts from it
    as from an HF config's dtype (bf16 where the CPU computes it natively), and in bfloat16 the
    engine on the file decodes exactly as on the HF checkpoint cast to bfloat16 (the converter
    and torch round float32 to bfloat16 alike)."""
    from hyprefix.hardware import device_caps

    checkpoint = checkpoints["qwen3_5"][0]
    path = _convert(llama_converter, checkpoints, tmp_path, ["qwen3_5"], "bf16")["qwen3_5"]
    assert load_config(path).dtype == torch.bfloat16
    auto = LLM(str(path), num_kv_blocks=64, log_stats_interval=0)
    assert auto.engine.dtype == device_caps("cpu").auto_dtype(torch.bfloat16)[0]
    del auto
    prompts = random_prompts((3, 40), seed=6)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ours, theirs = (LLM(str(m), dtype="bfloat16", num_kv_blocks=64, log_stats_interval=0).generate(
        prompts, params, use_tqdm=False) for m in (path, checkpoint))
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in theirs]


@pytest.mark.parametrize("arch", ["qwen3_next", "mamba2"])
def test_tokenizer_and_chat_template_from_the_file(ggufs, checkpoints, arch):
    """transformers' AutoTokenizer refuses these architectures; ours comes from the file's
    metadata and splits, decodes and templates as the checkpoint's own tokenizer does."""
    from transformers import PreTrainedTokenizerFast

    path, checkpoint = ggufs[arch], checkpoints[arch][0]
    ours = load_tokenizer(path)
    reference = PreTrainedTokenizerFast(tokenizer_file=str(checkpoint / "tokenizer.json"))
    text = "Hello world, <|im_start|>user\nhi there<|im_end|> 12345 ünïcode"
    assert ours.encode(text) == reference.encode(text) and ours.decode(ours.encode(text)) == text
    assert ours.eos_token == "<|im_end|>"
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_a_missing_tensor_is_a_clear_error(ggufs, tmp_path):
    """A file without a tensor the model needs is refused, naming the file and the tensor."""
    data = ggufs["qwen3_5"].read_bytes()
    name = b"blk.0.ssm_out.weight"
    assert data.count(name) == 1  # in the tensor table: renamed in place, the same length
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(data.replace(name, b"blk.0.ssm_OUT.weight"))
    with pytest.raises(ValueError, match=r"broken\.gguf.*blk\.0\.ssm_out\.weight"):
        LLM(str(broken), dtype="float32", num_kv_blocks=16, log_stats_interval=0)


# Hybrid files with quantized matrices keep them in their blocks (``gguf_blocks``), as dense ones do.
Q8_CASES = ("qwen3_5", "qwen3_next", "nemotron_h_dense", "mamba2")


@pytest.fixture(scope="session")
def q8_ggufs(llama_converter, checkpoints, tmp_path_factory) -> dict[str, Path]:
    """test case -> the Q8_0 GGUF file llama.cpp's converter writes for its checkpoint."""
    return _convert(llama_converter, checkpoints, tmp_path_factory.mktemp("gguf-hybrid-q8"), list(Q8_CASES), "q8_0")


def _linears(model) -> dict[str, torch.nn.Module]:
    """The matrices that can hold blocks: linears and stacked experts."""
    from hyprefix.models.fused_moe import Experts
    from hyprefix.models.layers import Linear

    return {name: m for name, m in model.named_modules() if isinstance(m, Linear | Experts)}


def _float_parameters(model, path: Path) -> dict[str, torch.Tensor]:
    """Every parameter of ``model`` as the float path reads it from the file (dequantized), in
    transformers' layout (``load_weights`` into staging tensors, as ``update_weights`` does)."""
    from hyprefix.models.loader import iter_gguf

    modules = dict(model.named_modules())
    staged = {}
    for name, param in model.named_parameters():
        module_name, _, leaf = name.rpartition(".")
        forms = getattr(modules[module_name], "forms", None)
        shape = (forms.rows, forms.cols) if forms is not None and leaf == "weight" else param.shape
        staged[name] = torch.empty(shape)
    model.load_weights(iter_gguf(path, load_config(path)), into=staged)
    return staged


@pytest.mark.parametrize("case", Q8_CASES)
def test_quantized_hybrid_files_keep_their_blocks(q8_ggufs, case):
    """Every projection of the recurrent and attention layers stays in the file's Q8_0 blocks,
    each equal, dequantized, to the matrix the float path reads from the same file (rows moved
    back as the converter moved them; Qwen3.5's ``out_proj`` keeps the file's column order and
    gathers its inputs instead; Qwen3-Next's stacked experts, gate and up joined per expert); the
    weights take a third of the float32 bytes or less."""
    from hyprefix.kernels import quant_linear

    if not quant_linear.available():
        pytest.skip("the quant kernels do not run on this CPU")
    path = q8_ggufs[case]
    kept = LLM(str(path), dtype="float32", num_kv_blocks=32, log_stats_interval=0).engine.runner.model
    plain = _float_parameters(kept, path)
    held = {name: lin for name, lin in _linears(kept).items() if lin.forms.quant is not None}
    mixers = {n for n in _linears(kept) if n.endswith(("in_proj", "out_proj", "qkv", "o_proj", "experts_gate_up",
                                                       "experts_down"))}
    assert case != "qwen3_next" or any(n.endswith("experts_gate_up") for n in mixers)
    assert mixers and mixers <= set(held), sorted(mixers - set(held))
    if case == "qwen3_5":  # value heads tiled by the converter: the columns stay in the file's order
        assert all(held[n].forms.input_index is not None for n in held if n.endswith("out_proj"))
    for name, lin in held.items():
        values = lin.forms.quant.dequantize(torch.float32)
        if lin.forms.input_index is not None:
            values = values[:, torch.argsort(lin.forms.input_index)]
        torch.testing.assert_close(values, plain[f"{name}.weight"], rtol=0, atol=1e-6)
    assert kept.weight_memory_bytes() * 3 < sum(t.nbytes for t in plain.values())


@pytest.mark.parametrize("case", ["qwen3_5", "nemotron_h_dense", "qwen3_next"])
def test_quantized_hybrid_files_hit_the_prefix_cache(q8_ggufs, case):
    """On the kept blocks, greedy tokens are the same with prefix hits and without the cache."""
    path = q8_ggufs[case]
    prompts = random_prompts((3, 40), seed=7)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    cached = LLM(str(path), dtype="float32", num_kv_blocks=64, log_stats_interval=0)
    first = [o.outputs[0].token_ids for o in cached.generate(prompts, params, use_tqdm=False)]
    again = cached.generate([prompts[-1]], params, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == first[-1]
    uncached = LLM(str(path), dtype="float32", num_kv_blocks=64, enable_prefix_caching=False, log_stats_interval=0)
    assert [o.outputs[0].token_ids for o in uncached.generate(prompts, params, use_tqdm=False)] == first


def test_a_tensor_of_the_wrong_shape_is_named_before_allocating(ggufs, tmp_path, monkeypatch):
    """A file whose ``ssm_out`` has its two dimensions swapped (the same bytes) is refused before
    any weight is allocated, naming the tensor, the file's name for it and its shape (here the
    converter's column reorder cannot even take it); so is one whose ``ffn_down`` is swapped,
    naming both shapes."""
    import struct

    from hyprefix.models.base import CausalLM

    def swapped(name: bytes) -> tuple[Path, int, int]:
        data = bytearray(ggufs["qwen3_5"].read_bytes())
        at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)  # n_dims (uint32), then the dims
        assert struct.unpack_from("<I", data, at)[0] == 2
        cols, rows = struct.unpack_from("<QQ", data, at + 4)
        struct.pack_into("<QQ", data, at + 4, rows, cols)
        out = tmp_path / f"swapped-{name.decode()}.gguf"
        out.write_bytes(bytes(data))
        return out, rows, cols

    def allocate(self, device):
        raise AssertionError("the weights were allocated before the file was refused")

    monkeypatch.setattr(CausalLM, "materialize", allocate)
    path, rows, cols = swapped(b"blk.0.ssm_out.weight")
    with pytest.raises(ValueError, match=rf"tensor 'model\.layers\.0\.linear_attn\.out_proj\.weight' cannot be made "
                                         rf"of the file's blk\.0\.ssm_out\.weight \({cols}, {rows}\)"):
        LLM(str(path), dtype="float32", num_kv_blocks=16, log_stats_interval=0)
    path, rows, cols = swapped(b"blk.3.ffn_down.weight")
    with pytest.raises(ValueError, match=rf"tensor 'model\.layers\.3\.mlp\.down_proj\.weight' \(the file's "
                                         rf"blk\.3\.ffn_down\.weight\) has shape \({cols}, {rows}\), the model "
                                         rf"expects \({rows}, {cols}\)"):
        LLM(str(path), dtype="float32", num_kv_blocks=16, log_stats_interval=0)


def test_quantized_experts_multiply_their_own_blocks(q8_ggufs):
    """``hyprefix::quant_moe`` on a Q8_0 file's stacked experts: each chosen expert's slice
    of the tiles, equal to the dequantized expert times the activations as the kernel rounds them
    (per 32); experts nobody chose are not read (a poisoned one changes nothing)."""
    import torch.nn.functional as F

    from hyprefix.kernels import quant_linear
    from hyprefix.models.fused_moe import moe_forward
    from hyprefix.models.quant import quantize_activations

    if not quant_linear.available():
        pytest.skip("the quant kernels do not run on this CPU")
    model = LLM(str(q8_ggufs["qwen3_next"]), dtype="float32", num_kv_blocks=16,
                log_stats_interval=0).engine.runner.model
    moe = model.layers[0].mlp
    gate_up, down = moe.experts_gate_up, moe.experts_down
    assert gate_up.forms.quant is not None and down.forms.quant is not None
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, gate_up.cols, generator=gen)
    chosen = torch.tensor([[0, 3], [3, 5], [5, 0], [1, 3], [0, 1]])
    weights = torch.rand(5, 2, generator=gen)
    got = moe_forward(x, chosen, weights, gate_up, down)
    deq_up = gate_up.forms.quant.dequantize(torch.float32).view(gate_up.num_experts, gate_up.rows, -1)
    deq_down = down.forms.quant.dequantize(torch.float32).view(down.num_experts, down.rows, -1)
    want = torch.zeros_like(x)
    for t in range(5):
        for slot in range(2):
            e = int(chosen[t, slot])
            gate, up = F.linear(quantize_activations(x[t:t + 1]), deq_up[e]).chunk(2, dim=-1)
            h = F.linear(quantize_activations(F.silu(gate) * up), deq_down[e])
            want[t] += weights[t, slot] * h[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert got.abs().max() > 0.01
    unused = 7  # no token chose it: poison its tiles
    tiles = gate_up.rows // 16
    gate_up.forms.quant.tensors[1][unused * tiles:(unused + 1) * tiles] = float("nan")
    assert torch.equal(moe_forward(x, chosen, weights, gate_up, down), got)


@pytest.mark.hybrid_graphs
def test_quantized_moe_hybrid_decodes_through_the_graph(q8_ggufs):
    """The Q8_0 Qwen3-Next (experts in their blocks) decodes through the compiled graph as the
    eager decode does: the same greedy tokens, every decode step compiled."""
    from hyprefix.kernels import quant_linear

    if not quant_linear.available():
        pytest.skip("the quant kernels do not run on this CPU")
    path = q8_ggufs["qwen3_next"]
    prompts = random_prompts((3, 40), seed=7)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    graph = LLM(str(path), dtype="float32", num_kv_blocks=64, log_stats_interval=0)
    eager = LLM(str(path), dtype="float32", num_kv_blocks=64, log_stats_interval=0, enforce_eager=True)
    compiled = [graph.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert compiled == [eager.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    steps = graph.engine.runner.decode_steps
    assert steps["eager"] == 0 and steps["graph"] == len(prompts) * (params.max_tokens - 1)
