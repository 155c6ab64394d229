"""Device capabilities, the dtype="auto" rule, and a bf16 checkpoint (and int8 weights) on an
emulated AVX2 CPU."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hyprefix import LLM, SamplingParams, hardware
from hyprefix.hardware import DeviceCaps, device_caps, resolve_dtype
from hyprefix.kernels import int8_linear
from hyprefix.models.quant import Int8Tiles, quantize_int8

AVX2 = DeviceCaps("cpu", "test CPU", "AVX2", onednn=True, onednn_bf16=False, onednn_fp16=False, native_bf16=False,
                  native_fp16=False, amx=False)
AVX512_BF16 = dataclasses.replace(AVX2, isa="AVX512", onednn_bf16=True, native_bf16=True)
SKYLAKE = dataclasses.replace(AVX2, isa="AVX512", onednn_bf16=True)  # AVX-512, bf16 only by conversion
H100 = DeviceCaps("cuda", "H100", "sm_90", onednn=False, onednn_bf16=False, onednn_fp16=False, native_bf16=True,
                  native_fp16=True, amx=False)
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def test_cpu_caps_come_from_torch():
    caps = device_caps("cpu")
    assert caps.device_type == "cpu" and caps.isa == torch.backends.cpu.get_cpu_capability()
    assert caps.onednn == (torch.backends.mkldnn.is_available() and caps.onednn)  # never claims a missing oneDNN
    if caps.onednn:
        assert caps.onednn_bf16 == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    hw = torch.cpu.get_capabilities()
    assert caps.native_bf16 == (caps.onednn_bf16 and caps.isa.startswith("AVX512")
                                and bool(hw.get("avx512_bf16") or hw.get("amx_bf16")))
    assert caps.native(FP32) and caps.native(BF16) == caps.native_bf16
    assert caps.prepack(BF16) == caps.onednn_bf16 and caps.prepack(FP32) == caps.onednn
    assert caps.name in caps.describe() and caps.isa in caps.describe()
    vnni = caps.isa.startswith("AVX512") and all(hw.get(f) for f in ("avx512_vnni", "avx512_bw", "avx512_vl"))
    avx2 = caps.vector_kernels and all(hw.get(f) for f in ("avx2", "fma3", "f16c"))
    assert caps.int8_isa == ("AVX512_VNNI" if vnni else "AVX2" if avx2 else "")


@pytest.mark.parametrize("caps,checkpoint,expected", [
    (AVX2, BF16, FP32), (AVX2, FP16, FP32), (AVX2, FP32, FP32),
    (SKYLAKE, BF16, FP32),
    (AVX512_BF16, BF16, BF16), (AVX512_BF16, FP16, BF16), (AVX512_BF16, FP32, FP32),
    (H100, BF16, BF16), (H100, FP16, FP16),
])
def test_auto_picks_the_checkpoint_dtype_only_where_it_is_native(caps, checkpoint, expected):
    chosen, reason = caps.auto_dtype(checkpoint)
    assert chosen == expected and reason


def test_prepacking_only_where_onednn_runs_the_dtype():
    assert AVX2.prepack(FP32) and not AVX2.prepack(BF16) and not AVX2.prepack(FP16)
    assert SKYLAKE.prepack(BF16) and AVX512_BF16.prepack(BF16)
    assert not H100.prepack(FP32) and not H100.prepack(BF16)


def test_choice_is_logged_and_a_slow_explicit_dtype_warns(monkeypatch, caplog):
    monkeypatch.setattr(hardware, "device_caps", lambda device: AVX2)
    with caplog.at_level(logging.INFO, logger="hyprefix"):
        assert resolve_dtype("auto", BF16, torch.device("cpu")) == FP32
        assert resolve_dtype("bfloat16", BF16, torch.device("cpu")) == BF16
        assert resolve_dtype("float32", BF16, torch.device("cpu")) == FP32
    info = [r for r in caplog.records if r.levelno == logging.INFO]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(info) == 1 and "auto -> float32" in info[0].message and "bfloat16" in info[0].message
    assert len(warnings) == 1 and "bfloat16 is not native" in warnings[0].message
    assert "'auto' would pick float32" in warnings[0].message


def test_an_isa_override_gets_its_own_compile_cache(monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    hardware.separate_compile_cache()
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ  # no override: torch's own default
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    hardware.separate_compile_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"].endswith("aten-avx2")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/chosen/by/user")
    hardware.separate_compile_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/chosen/by/user"


def test_auto_on_this_cpu_runs_the_native_dtype(bf16_checkpoint):
    caps = device_caps("cpu")
    llm = LLM(str(bf16_checkpoint), dtype="auto", num_kv_blocks=64)
    assert llm.engine.dtype == (BF16 if caps.native_bf16 else FP32)
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.fixture(scope="module")
def bf16_checkpoint(tiny_models, tmp_path_factory) -> Path:
    """The tiny qwen3 checkpoint stored in bfloat16 (config dtype bfloat16)."""
    src, hf = tiny_models["qwen3"]
    out = tmp_path_factory.mktemp("bf16-ckpt")
    copy.deepcopy(hf).to(BF16).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, out / name)
    assert json.loads((out / "config.json").read_text()).get("dtype", "bfloat16") == "bfloat16"
    return out


EMULATED = """
import json, logging, sys, torch
logging.basicConfig(level=logging.INFO)
from hyprefix import LLM, SamplingParams
from hyprefix.hardware import device_caps
params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
prompts = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 60))]  # 40 tokens: the compiled kernels too
report = {"caps": device_caps("cpu").to_dict()}
for dtype in ("auto", "bfloat16", "float32"):
    llm = LLM(sys.argv[1], dtype=dtype, num_kv_blocks=64)
    model = llm.engine.runner.model
    outs = llm.generate(prompts, params, use_tqdm=False)
    mlp_packed = model.layers[0].mlp.gate_up.forms.packed_halves is not None
    report[dtype] = {"dtype": str(llm.engine.dtype), "mlp_packed": mlp_packed,
                     "tokens": [o.outputs[0].token_ids for o in outs]}
import os
from hyprefix.kernels import prefill_attention
report["flash_prefill"] = {str(d): prefill_attention.available(d) for d in (torch.float32, torch.bfloat16)}
report["compile_cache"] = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
from hyprefix.kernels import int8_linear
from hyprefix.models.quant import Int8Tiles, quantize_int8
gen = torch.Generator().manual_seed(3)
w, x = quantize_int8(torch.randn(40, 96, generator=gen)), torch.randn(5, 96, generator=gen)
report["int8_kernel"] = int8_linear.available() and int8_linear.signed_tiles()
out = Int8Tiles.pack(w).matmul(x, None)
report["int8_equal"] = torch.allclose(out, w.matmul(x, None), atol=1e-4)
report["int8_out"] = out.tolist()
print("REPORT " + json.dumps(report))
"""


@pytest.mark.slow
def test_bf16_checkpoint_on_an_emulated_avx2_cpu(bf16_checkpoint):
    """Under oneDNN's and ATen's AVX2 limits (a Zen 3 without AVX-512), a bf16
    checkpoint loads with "auto" (-> float32, prepacked) and with an explicit
    "bfloat16" (plain path, a warning), and both generate; float32 prefill attention runs
    the AVX2 build of the brgemm kernel, bfloat16 stays on SDPA; int8 weights multiply
    through the int8 kernel's AVX2 build."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # the engine must keep the emulated ISA's kernels apart
    proc = subprocess.run([sys.executable, "-c", EMULATED, str(bf16_checkpoint)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.split("REPORT ", 1)[1])
    caps = report["caps"]
    assert caps["isa"] == "AVX2" and not caps["onednn_bf16"] and not caps["native_bf16"]
    assert report["auto"]["dtype"] == "torch.float32" and report["auto"]["mlp_packed"] is caps["onednn"]
    assert report["bfloat16"]["dtype"] == "torch.bfloat16" and report["bfloat16"]["mlp_packed"] is False
    assert report["auto"]["tokens"] == report["float32"]["tokens"]
    assert all(len(t) == 5 for t in report["bfloat16"]["tokens"])
    assert report["compile_cache"].endswith("aten-avx2")
    # Prefill attention: the brgemm kernel in float32 (AVX2 build), torch's SDPA in bfloat16.
    assert report["flash_prefill"] == {"torch.float32": caps["brgemm"], "torch.bfloat16": False}
    assert caps["brgemm"] is caps["onednn"]
    # int8 weights: the kernel's AVX2 build (signed tiles), equal to the plain int8 path and,
    # where this process runs the VNNI build, to it bit for bit (the same int32 sums, scaled alike).
    assert caps["int8_isa"] == "AVX2" and report["int8_kernel"] and report["int8_equal"]
    if device_caps("cpu").int8_isa == "AVX512_VNNI":
        assert int8_linear.available()
        gen = torch.Generator().manual_seed(3)
        w, x = quantize_int8(torch.randn(40, 96, generator=gen)), torch.randn(5, 96, generator=gen)
        assert torch.equal(Int8Tiles.pack(w).matmul(x, None), torch.tensor(report["int8_out"]))
    assert "dtype auto -> float32" in proc.stderr
    assert "dtype bfloat16 is not native" in proc.stderr and "'auto' would pick float32" in proc.stderr
