"""Hybrid GGUF files written by llama.cpp's own converter load and run (``gguf_hybrid``):
Qwen3.5 dense and MoE, Qwen3-Next, NemotronH and Mamba2.

The converter (``convert_hf_to_gguf.py`` with its ``conversion`` package and its own
``gguf-py``, which knows these architectures where the pip ``gguf`` may not) comes from the
llama-cpp-python sdist on PyPI, as CI gets it, and is kept under the test-model cache
(``$HYPREFIX_TEST_MODELS``, by default ``~/.cache/hyprefix/models``). It converts the tiny float32 HF
checkpoints to f32 GGUF files; our loader must give back transformers' exact tensors and
config, so the engine's greedy tokens equal transformers' on the original model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest
import torch

from hyprefix import LLM, SamplingParams
from hyprefix.models import gguf_hybrid
from hyprefix.models.loader import gguf_architecture, load_config, load_tokenizer
from tests.support.compare import hf_greedy, random_prompts
from tests.support.models import _tiny_hybrid_config, save_tiny_checkpoint, vary_deltanet_weights
from tools.models.fetch_test_models import models_dir

VERSION = "0.3.36"  # llama-cpp-python, as pyproject's llamacpp extra pins it
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
LOCAL_SDIST = Path("/tmp/llama") / SDIST  # a copy already on this machine: only saves the download
SDIST_ROOT = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
# What the converter needs from llama.cpp: the script, its model classes, its gguf package.
CONVERTER_FILES = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/gguf/")

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

# llama.cpp names a BPE pre-tokenizer by hashing how the tokenizer splits a test text, and
# refuses one it does not know, as the tests' tiny tokenizer is. It splits as GPT-2 does
# (ByteLevel), so it is named that; the tensors and every other metadata key are the converter's.
RUN_CONVERTER = """
import json, runpy, sys
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
load_hparams = base.ModelBase.load_hparams
script, jobs = sys.argv[1], json.loads(sys.argv[2])
for args, hidden in jobs:  # one interpreter for every checkpoint: importing torch and transformers is most of it
    def hparams(dir_model, is_mistral_format, hidden=hidden):
        config = load_hparams(dir_model, is_mistral_format)
        return {key: value for key, value in config.items() if key not in hidden}
    base.ModelBase.load_hparams = staticmethod(hparams)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")
"""


def _sdist(into: Path) -> Path:
    if LOCAL_SDIST.is_file():
        return LOCAL_SDIST
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                    f"llama-cpp-python=={VERSION}", "-d", str(into)], check=True)
    return into / SDIST


@pytest.fixture(scope="session")
def llama_converter() -> Path:
    """A directory holding llama.cpp's ``convert_hf_to_gguf.py``, ``conversion/`` and
    ``gguf-py/``, extracted once from the sdist and kept for later runs."""
    out = models_dir() / f"llama-cpp-converter-{VERSION}"
    if (out / "convert_hf_to_gguf.py").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        staging = Path(tmp) / "converter"
        with tarfile.open(_sdist(Path(tmp))) as tar:
            for member in tar:
                name = member.name.removeprefix(SDIST_ROOT)
                if member.isfile() and name != member.name and name.startswith(CONVERTER_FILES):
                    member.name = name
                    tar.extract(member, staging, filter="data")
        try:
            staging.rename(out)
        except OSError:  # another session extracted it meanwhile
            if not (out / "convert_hf_to_gguf.py").is_file():
                raise
    return out


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
    root = tmp_path_factory.mktemp("gguf-hybrid")
    out = {case: root / f"{case}.gguf" for case in ARCHS}
    jobs = [(["--outtype", "f32", "--outfile", str(out[case]), *FLAGS.get(case, []), str(checkpoints[arch][0])],
             HIDDEN.get(case, [])) for case, (arch, _) in ARCHS.items()]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(llama_converter), str(llama_converter / "gguf-py")])}
    proc = subprocess.run([sys.executable, "-c", RUN_CONVERTER, str(llama_converter / "convert_hf_to_gguf.py"),
                           json.dumps(jobs)], cwd=llama_converter, env=env, capture_output=True, text=True)
    if proc.returncode:
        pytest.fail(f"convert_hf_to_gguf.py failed:\n{proc.stderr[-4000:]}")
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
    path = tmp_path / "qwen3_5-bf16.gguf"
    jobs = [(["--outtype", "bf16", "--outfile", str(path), "--no-mtp", str(checkpoint)], [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(llama_converter), str(llama_converter / "gguf-py")])}
    proc = subprocess.run([sys.executable, "-c", RUN_CONVERTER, str(llama_converter / "convert_hf_to_gguf.py"),
                           json.dumps(jobs)], cwd=llama_converter, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
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
