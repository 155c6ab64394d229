"""GGUF Q8_0 weights load straight into int8 linears with ``quantization="int8"``: the
blocks' int8 values and scales as they are in the file (no float round trip; the float16
scales widened exactly to float32; in the VNNI kernel's tiles where it runs, unpacked here
to compare), Llama's q/k row permutation applied to both. The file is a tiny Llama
written with the ``gguf`` library and rewritten as Q8_0 by ``tools/models/requantize_gguf.py``."""

from __future__ import annotations

import runpy
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from hyprefix import LLM, SamplingParams
from hyprefix.models.layers import Linear
from hyprefix.models.loader import load_model
from hyprefix.models.quant import quantize_activations
from tests.models.test_gguf_errors import write_gguf
from tests.support.compare import our_last_logits

TOOL = Path(__file__).resolve().parents[2] / "tools" / "models" / "requantize_gguf.py"


@pytest.fixture(scope="module")
def q8_0_file(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("q8_0")
    requantize = runpy.run_path(str(TOOL))["requantize"]
    requantize(str(write_gguf(tmp / "f32.gguf")), str(tmp / "q8_0.gguf"))
    return tmp / "q8_0.gguf"


def test_the_tool_writes_q8_0_matrices_and_float_norms(q8_0_file):
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(str(q8_0_file)).tensors}
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert types["token_embd.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert types["output_norm.weight"] == gguf.GGMLQuantizationType.F32


def test_q8_0_blocks_become_int8_weights_exactly(q8_0_file):
    """Every linear (fused q/k/v and gate/up included) and the untied LM head hold the
    file's int8 blocks: dequantized, they equal transformers' float dequantization of the
    same file bit for bit."""
    floats = load_model(str(q8_0_file), "float32", torch.device("cpu"), 64, compiled_decode=True,
                        quantization="none").model
    ints = load_model(str(q8_0_file), "float32", torch.device("cpu"), 64, quantization="int8").model
    reference = dict(floats.named_modules())
    linears = [(name, m) for name, m in ints.named_modules() if isinstance(m, Linear)]
    assert {name for name, _ in linears} >= {"layers.0.attn.qkv", "layers.0.mlp.gate_up", "lm_head"}
    for name, module in linears:
        assert module.forms.int8 is not None and module.forms.int8.group == 32, name
        plain = module.forms.int8.plain()  # the kernel's tiles, unpacked, where it runs
        assert plain.qweight.dtype == torch.int8 and plain.scales.dtype == torch.float32
        assert torch.equal(plain.dequantize(torch.float32), reference[name].weight), name
    assert ints.decode_weight_bytes() < 0.3 * floats.decode_weight_bytes()


def test_q8_0_block_values_are_the_files(q8_0_file):
    """The v projection (no permutation) holds the raw bytes of the file's blocks."""
    ints = load_model(str(q8_0_file), "float32", torch.device("cpu"), 64, quantization="int8").model
    raw = next(t for t in gguf.GGUFReader(str(q8_0_file)).tensors if t.name == "blk.0.attn_v.weight")
    blocks = np.asarray(raw.data).reshape(raw.data.shape[0], -1, 34)
    attn = ints.layers[0].attn
    v_rows = slice(attn.q_size + attn.kv_size, attn.q_size + 2 * attn.kv_size)
    qkv = ints.layers[0].attn.qkv.forms.int8.plain()
    assert np.array_equal(qkv.qweight[v_rows].numpy(), blocks[:, :, 2:].view(np.int8).reshape(len(blocks), -1))
    file_scales = blocks[:, :, :2].copy().view(np.float16)[:, :, 0]
    assert np.array_equal(qkv.scales[v_rows].numpy(), file_scales.astype(np.float32))


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_q8_0_int8_model_computes_the_float_models_numbers(q8_0_file, tiny_models, enforce_eager):
    """Same weights: each int8 linear computes exactly the float weight times its input
    quantized per 32, the model's last-token logits stay within 3 % of the float model's, and
    greedy decoding runs, eager and through the compiled decode step. (The tiny file's
    vocabulary is no real tokenizer: a test checkpoint's serves; the prompts are token ids
    under 16.)"""
    common = {"dtype": "float32", "num_kv_blocks": 64, "tokenizer": str(tiny_models["llama"][0])}
    floats = LLM(str(q8_0_file), quantization="none", enforce_eager=True, **common)
    ints = LLM(str(q8_0_file), quantization="int8", enforce_eager=enforce_eager, **common)
    qkv = ints.engine.runner.model.layers[0].attn.qkv  # its weight equals the float model's (test above)
    x = torch.randn(5, qkv.in_features)
    expected = quantize_activations(x).double() @ qkv.forms.int8.dequantize(torch.float64).T
    assert torch.allclose(qkv(x).double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    prompts = [[1, 5, 7, 3, 9, 2], [4, 4, 8, 15, 0, 11, 6, 1, 2, 3]]
    ref = our_last_logits(floats, prompts)
    gap = (our_last_logits(ints, prompts) - ref).abs().max().item()
    assert gap < 0.03 * ref.abs().max().item(), f"int8 logits differ by {gap:.3g}"
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for prompt in prompts:  # one at a time: batch-1 decode steps are the compiled ones (or the kernel's)
        out = ints.generate([prompt], greedy, use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == 8
    runner = ints.engine.runner
    graphs = runner.decode_graphs  # none where the decode kernel runs the steps
    assert (graphs is None) == (enforce_eager or runner.model.decode_kernel)
    assert graphs is None or graphs.compiled_sizes == {1}


def test_a_q8_0_file_runs_in_a_fresh_process(q8_0_file, tiny_models):
    """A file whose matrices are all Q8_0, loaded with the default quantization, keeps them as
    ``QuantTiles`` and so needs the quant ops loaded: in a process that loaded nothing else (the
    suite's other tests load them in this one) the first step used to fail (no ``quant_rows``)."""
    import subprocess
    import sys

    code = ("from hyprefix import LLM, SamplingParams\n"
            f"llm = LLM({str(q8_0_file)!r}, tokenizer={str(tiny_models['llama'][0])!r}, num_kv_blocks=64, "
            "log_stats_interval=0)\n"
            "params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)\n"
            "out = llm.generate([[1, 2, 3]], params, use_tqdm=False)\n"
            "print(len(out[0].outputs[0].token_ids))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "2"
