"""Builds a C++ kernel of this package with torch's extension builder (the compiler Inductor
uses) into torch's extension cache: the first process compiles it, later ones load it without
compiling (``prebuild`` builds them all ahead of time). A failed build logs one warning naming the
compiler error and returns False, so the caller keeps its portable path."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

log = logging.getLogger("hyprefix")

# Build name -> whether it built and loaded, for every ``load_kernel`` call of this process
# (``prebuild`` reports them).
ATTEMPTS: dict[str, bool] = {}

# Flags of a kernel written on ATen's vector types, which pick their width from CPU_CAPABILITY
# as in ATen's own kernels: one build per ISA (``load_vector_kernel``).
VECTOR_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma",
               "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
}


def load_vector_kernel(source: Path, what: str) -> bool:
    """``load_kernel`` for a kernel on ATen's vector types: the build for ATen's CPU capability
    here ("AVX512_BF16" -> the AVX512 build), named ``hyprefix_<stem>_<isa>``. Call only where
    that capability is AVX2 or AVX-512."""
    from hyprefix.hardware import device_caps

    isa = "AVX512" if device_caps("cpu").isa.startswith("AVX512") else "AVX2"
    return load_kernel(f"hyprefix_{source.stem}_{isa.lower()}", source, VECTOR_FLAGS[isa], what)


@functools.cache
def load_vector_op(source: Path, op: str, fake: Callable[..., object], what: str) -> bool:
    """``load_vector_kernel`` once per process, then ``fake`` registered as ``op``'s output
    shapes for torch.compile. Later calls return the first answer."""
    if not load_vector_kernel(source, what):
        return False
    import torch

    torch.library.register_fake(op)(fake)
    return True


def build_directory(name: str) -> Path:
    """Where torch's extension builder keeps ``name`` by default (``$TORCH_EXTENSIONS_DIR/name``,
    else ``~/.cache/torch_extensions/py311_cpu/name`` and the like), made if missing."""
    import torch
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        device = (f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip is not None else
                  f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda is not None else "cpu")
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(cpp_extension.get_default_build_root(), f"{python}_{device}")
    path = Path(root) / name
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def _builder_lock(build_dir: Path) -> Iterator[None]:
    """Held while this process builds or loads the kernel of ``build_dir``: an ``flock``, which
    the system drops when its holder dies. torch's own build lock is a file that a killed build
    (Ctrl-C during ``make serve``'s first kernel builds) leaves behind, and every later process
    would wait on it for ever; holding this lock, a torch lock found is such a leftover (every
    builder of our kernels takes this lock first), so it is removed."""
    with open(build_dir / "hyprefix.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                log.warning("removing %s, left by a build of the %s kernel that was stopped mid-way", stale,
                            build_dir.name)
                stale.unlink()
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def load_kernel(name: str, source: Path, flags: list[str], what: str) -> bool:
    """Compile (or load from the cache) ``source`` as extension ``name``, registering its ops.
    ``what`` names the fallback in the warning ("int8 weights take the portable path")."""
    from torch.utils import cpp_extension

    # ninja (a dependency) sits in the environment's bin directory, which may not be on PATH.
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([bin_dir, os.environ.get("PATH", "")])
    t0 = time.perf_counter()
    build_dir = build_directory(name)
    try:
        with _builder_lock(build_dir):
            # -fopenmp: ATen's parallel_for is an OpenMP pragma in its header; without it, one thread.
            cpp_extension.load(name=name, sources=[str(source)], extra_cflags=["-O3", "-fopenmp", *flags],
                               extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False,
                               build_directory=str(build_dir))
    except Exception as exc:
        lines = str(exc).strip().splitlines()
        detail = next((line for line in lines if "error" in line.lower()), lines[-1] if lines else "")
        log.warning("the %s kernel did not build (%s: %s); %s", source.stem, type(exc).__name__,
                    detail.strip(), what)
        ATTEMPTS[name] = False
        return False
    ATTEMPTS[name] = True
    seconds = time.perf_counter() - t0
    if seconds > 2:  # compiled, not loaded from the cache
        log.info("built the %s kernel in %.0fs (once per machine; `hyprefix build-kernels` builds all of them "
                 "ahead of time, several at once)", source.stem, seconds)
    return True
