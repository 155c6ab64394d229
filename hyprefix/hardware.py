"""What the device can compute fast: the one place every kernel and dtype choice asks.

On CPU the answers come from torch itself, so they honour the environment switches
that emulate a smaller CPU: ATen's ``ATEN_CPU_CAPABILITY`` (the vector ISA of its own
kernels, ``torch.backends.cpu.get_cpu_capability()``) and oneDNN's
``ONEDNN_MAX_CPU_ISA`` (``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` turns False
under ``AVX2`` even on a CPU with AVX-512 BF16). The hardware flags
(``torch.cpu.get_capabilities()``) say what the silicon has; a dtype is *native* only
when the silicon has its matmul instructions **and** the library that runs our
matmuls (oneDNN) may use them.

Rules that follow from it (see ``DeviceCaps``):

* ``native(dtype)``: float32 is native everywhere; bfloat16 on a CPU with AVX512-BF16 or
  AMX-BF16 that oneDNN may use, on CUDA with sm80+; float16 on a CPU with AMX-FP16 or
  AVX512-FP16, on any CUDA GPU.
* ``prepack(dtype)``: weights of this dtype go to oneDNN's blocked layout (CPU only,
  and only for a dtype oneDNN runs there: packing bf16 on a CPU without AVX-512 or
  AVX-NE-CONVERT raises inside oneDNN, which is the crash this module exists to stop).
* ``int8_isa``: int8 weights multiply through ``kernels/int8_linear.cpp`` (int8 dot
  products, activations quantized per 32): its AVX512-VNNI build where the silicon has VNNI
  and ATen's ISA is AVX-512, its AVX2 build on any other x86 CPU with AVX2, FMA and F16C whose
  ATen ISA is AVX2 or AVX-512; elsewhere ("") the same numbers come from dequantized weights
  (``models/quant.py``).
* ``flash_prefill(dtype)``: prefill attention runs ``kernels/prefill_attention.cpp`` (oneDNN's
  brgemm micro-kernel) for float32 on an x86 CPU whose ATen ISA is AVX2 or AVX-512, and for
  bfloat16 where bf16 is native; elsewhere torch's SDPA.
* ``paged_decode(dtype)``: decode attention reads the paged K/V in place through
  ``kernels/decode_attention.cpp`` (float32, bfloat16 or float16) on an x86 CPU whose ATen ISA
  is AVX2 or AVX-512; elsewhere the blocks are gathered for torch's SDPA.
* ``auto_dtype(checkpoint_dtype)``: the checkpoint's dtype where it is native, else the
  fastest correct substitute (bf16 for an fp16 checkpoint where bf16 is native, else
  float32), with the reason.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
from dataclasses import asdict, dataclass

import torch

log = logging.getLogger("hyprefix")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


@dataclass(frozen=True)
class DeviceCaps:
    device_type: str  # "cpu", "cuda", ...
    name: str  # CPU model name or GPU name
    isa: str  # ATen CPU capability ("AVX512", "AVX2", "DEFAULT", ...) or CUDA "sm_90"
    onednn: bool  # oneDNN prepacked linears are available (fp32 on any x86 oneDNN runs on)
    onednn_bf16: bool  # oneDNN runs bf16 on this CPU (native or by conversion)
    onednn_fp16: bool
    native_bf16: bool  # the hardware multiplies bf16 and the matmul library may use it
    native_fp16: bool
    amx: bool
    int8_isa: str = ""  # the build of kernels/int8_linear.cpp that runs here: "AVX512_VNNI", "AVX2" or none
    brgemm: bool = False  # x86, ATen ISA AVX2 or AVX-512, oneDNN: its brgemm micro-kernel runs float32
    vector_kernels: bool = False  # x86, ATen ISA AVX2 or AVX-512: our at::vec kernels build for it
    bf16_tiles: bool = False  # native bf16 with AVX512-BF16: kernels/bf16_linear.cpp runs here

    def flash_prefill(self, dtype: torch.dtype) -> bool:
        """Whether prefill attention in ``dtype`` runs ``kernels/prefill_attention.cpp``."""
        return self.device_type == "cpu" and self.brgemm and (
            dtype == torch.float32 or (dtype == torch.bfloat16 and self.native_bf16))

    def paged_decode(self, dtype: torch.dtype) -> bool:
        """Whether decode attention in ``dtype`` runs ``kernels/decode_attention.cpp``."""
        return self.device_type == "cpu" and self.vector_kernels and dtype in DTYPE_NAMES

    def native(self, dtype: torch.dtype) -> bool:
        if dtype == torch.float32:
            return True
        if dtype == torch.bfloat16:
            return self.native_bf16
        if dtype == torch.float16:
            return self.native_fp16
        return False

    def prepack(self, dtype: torch.dtype) -> bool:
        """Whether linear weights of ``dtype`` are prepacked for oneDNN on this device."""
        if self.device_type != "cpu" or not self.onednn:
            return False
        return {torch.float32: True, torch.bfloat16: self.onednn_bf16,
                torch.float16: self.onednn_fp16}.get(dtype, False)

    def auto_dtype(self, checkpoint: torch.dtype) -> tuple[torch.dtype, str]:
        """``dtype="auto"``: (the dtype to run, why)."""
        ckpt = DTYPE_NAMES.get(checkpoint, str(checkpoint))
        if self.native(checkpoint):
            return checkpoint, f"the checkpoint's {ckpt}, native on {self.describe()}"
        if checkpoint == torch.float16 and self.native_bf16:
            return torch.bfloat16, (f"the checkpoint is float16, which {self.describe()} does not compute "
                                    "natively; bfloat16 is native here")
        return torch.float32, (f"the checkpoint is {ckpt}, which {self.describe()} does not compute natively; "
                               "float32 is the fast path here")

    def kind(self) -> str:
        """The ISA and bf16 support in a few words: "AVX2, no native bf16", "AVX512, AMX-BF16"."""
        bf16 = ("AMX-BF16" if self.amx else "AVX512-BF16") if self.native_bf16 else "no native bf16"
        return f"{self.isa}, {bf16}" if self.device_type == "cpu" else self.isa

    def describe(self) -> str:
        what = "CPU" if self.device_type == "cpu" else f"{self.device_type} device"
        return f"this {what} ({self.name}, {self.kind()})"

    def to_dict(self) -> dict:
        return asdict(self)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _cpu_caps() -> DeviceCaps:
    hw = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    isa = torch.backends.cpu.get_cpu_capability()
    onednn = (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
              and platform.machine().lower() in ("x86_64", "amd64"))
    onednn_bf16 = onednn and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    onednn_fp16 = onednn and bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    amx_bf16 = bool(hw.get("amx_bf16"))
    # Native means the matmul instructions exist *and* oneDNN may use them (ONEDNN_MAX_CPU_ISA);
    # ATen's own kernels must be AVX-512 too, or every elementwise bf16 op converts by hand.
    avx512 = isa.startswith("AVX512")
    native_bf16 = onednn_bf16 and avx512 and (bool(hw.get("avx512_bf16")) or amx_bf16)
    native_fp16 = onednn_fp16 and avx512 and (bool(hw.get("avx512_fp16")) or bool(hw.get("amx_fp16")))
    vector_kernels = platform.machine().lower() in ("x86_64", "amd64") and (avx512 or isa == "AVX2")
    if avx512 and all(hw.get(f) for f in ("avx512_vnni", "avx512_bw", "avx512_vl")):
        int8_isa = "AVX512_VNNI"
    elif vector_kernels and all(hw.get(f) for f in ("avx2", "fma3", "f16c")):
        int8_isa = "AVX2"
    else:
        int8_isa = ""
    brgemm = onednn and vector_kernels
    bf16_tiles = native_bf16 and bool(hw.get("avx512_bf16"))
    return DeviceCaps("cpu", _cpu_name(), isa, onednn, onednn_bf16, onednn_fp16, native_bf16, native_fp16,
                      amx_bf16 and native_bf16, int8_isa, brgemm, vector_kernels, bf16_tiles)


def _cuda_caps(device: torch.device) -> DeviceCaps:
    major, minor = torch.cuda.get_device_capability(device)
    return DeviceCaps("cuda", torch.cuda.get_device_name(device), f"sm_{major}{minor}", onednn=False,
                      onednn_bf16=False, onednn_fp16=False, native_bf16=major >= 8, native_fp16=True, amx=False)


@functools.cache
def device_caps(device: torch.device | str = "cpu") -> DeviceCaps:
    """What ``device`` computes fast. Cached: the answer is fixed for the process."""
    device = torch.device(device)
    if device.type == "cpu":
        return _cpu_caps()
    if device.type == "cuda":
        return _cuda_caps(device)
    # Other accelerators: trust the checkpoint's dtype, no CPU-specific kernels.
    return DeviceCaps(device.type, device.type, "unknown", onednn=False, onednn_bf16=False, onednn_fp16=False,
                      native_bf16=True, native_fp16=True, amx=False)


def resolve_dtype(requested: str, checkpoint: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype to run: ``requested`` is "auto" or a dtype name. Logs the choice once (at
    load); an explicit dtype the device does not compute natively runs as asked, with a
    warning naming what "auto" would pick."""
    caps = device_caps(device)
    auto, reason = caps.auto_dtype(checkpoint)
    if requested == "auto":
        log.info("dtype auto -> %s: %s", DTYPE_NAMES[auto], reason)
        return auto
    dtype = DTYPES[requested]
    if not caps.native(dtype):
        log.warning("dtype %s is not native on %s: its matmuls are emulated, correct but slower for prefill and "
                    "batched decode (batch-1 decode, bound by reading the weights, can be faster); dtype='auto' "
                    "would pick %s", requested, caps.describe(), DTYPE_NAMES[auto])
    return dtype


def separate_compile_cache() -> None:
    """Give a process that overrides ATen's ISA (``ATEN_CPU_CAPABILITY``) an Inductor
    cache directory of its own, unless the user chose one.

    Inductor's on-disk cache key leaves the override out (torch 2.13): kernels compiled
    under ``ATEN_CPU_CAPABILITY=avx2`` and loaded by a process without it, or the
    reverse, gave NaN logits and heap corruption (``malloc(): unaligned tcache chunk``)
    on an AVX-512 machine. Call before the first ``torch.compile``.
    """
    override = os.environ.get("ATEN_CPU_CAPABILITY")
    if not override:
        return
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen and chosen != default_cache_dir():  # torch itself sets it to the default on import
        return
    path = os.path.join(default_cache_dir(), f"aten-{override.lower()}")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    log.info("ATEN_CPU_CAPABILITY=%s: torch.compile cache in %s", override, path)
