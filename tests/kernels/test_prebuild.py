"""``hyprefix build-kernels``: each kernel built in a child process, its outcome reported."""

from __future__ import annotations

from pathlib import Path

from hyprefix.kernels import prebuild


def test_every_kernel_has_a_builder() -> None:
    sources = {path.stem for path in Path(prebuild.__file__).parent.glob("*.cpp")}
    assert set(prebuild._builders()) == sources


def test_builds_report_their_build_names() -> None:
    heard: list[str] = []
    results = prebuild.build_kernels(2, ("packed_linear", "int8_linear"), report=lambda r: heard.append(r.kernel))
    assert sorted(heard) == ["int8_linear", "packed_linear"]
    packed = results[0]
    # packed_linear has no ISA flags: every CPU with a compiler builds it
    assert packed.kernel == "packed_linear" and packed.builds == {"hyprefix_packed_linear": True}
    assert packed.ok and "ok [hyprefix_packed_linear]" in packed.describe()
    int8 = results[1]
    assert int8.ok and all(name.startswith("hyprefix_int8_linear_") for name in int8.builds)


def test_a_child_that_fails_is_a_failure() -> None:
    result = prebuild._build_in_child("no_such_kernel")
    assert not result.ok and result.error and "KeyError" in result.error
    assert result.describe().startswith("no_such_kernel: FAILED")


def test_a_failed_build_is_not_ok() -> None:
    result = prebuild.BuildResult("quant_linear", {"hyprefix_int8_linear_avx2": True,
                                                    "hyprefix_quant_linear_avx2": False}, 3.0)
    assert not result.ok and "FAILED (hyprefix_quant_linear_avx2" in result.describe()
    assert prebuild.BuildResult("bf16_linear", {}, 1.0).describe() == "bf16_linear: not for this CPU"


def test_a_build_lock_left_by_a_killed_build_does_not_stop_later_ones(tmp_path, monkeypatch, caplog) -> None:
    """torch's build lock is a plain file: a build killed mid-way (Ctrl-C during ``make serve``'s
    first builds) leaves it, and torch would wait on it for ever. ``load_kernel`` removes it,
    since it holds the only lock our builders take; the build then completes."""
    import threading

    from hyprefix.kernels.build import build_directory, load_kernel

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    source = tmp_path / "tiny_kernel.cpp"
    source.write_text("extern \"C\" int hyprefix_tiny_kernel() { return 1; }\n")
    (build_directory("hyprefix_tiny_kernel") / "lock").touch()  # the leftover
    outcome: list[bool] = []
    worker = threading.Thread(target=lambda: outcome.append(load_kernel("hyprefix_tiny_kernel", source, [], "-")),
                              daemon=True)
    worker.start()
    worker.join(180)
    assert outcome == [True], "the build waited on the leftover lock"
    assert not (build_directory("hyprefix_tiny_kernel") / "lock").exists()
    assert "left by a build of the hyprefix_tiny_kernel kernel that was stopped" in caplog.text
