"""Tests for engine_worker/kernel_build.py's ISA cap: KESTREL_CPU_ISA picks what our kernels are
built for (and so which build folder they load from), and refuses what this CPU lacks."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_worker import kernel_build


def test_cap_sets_march_and_keys_its_own_folder(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    monkeypatch.delenv("KESTREL_CPU_ISA", raising=False)
    assert kernel_build.cflags()[-1] == "-march=native"
    native = kernel_build.build_dir("paged_attention", tmp_path)
    monkeypatch.setattr(kernel_build, "_cpu_flags", lambda: "fpu avx avx2 fma f16c")
    monkeypatch.setenv("KESTREL_CPU_ISA", "AVX2")
    assert kernel_build.isa_cap() == "avx2"
    assert kernel_build.cflags()[-1] == "-march=x86-64-v3"
    assert kernel_build.build_dir("paged_attention", tmp_path) != native


def test_cap_above_this_cpu_or_unknown_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel_build, "_cpu_flags", lambda: "fpu avx avx2 fma f16c")
    monkeypatch.setenv("KESTREL_CPU_ISA", "avx512")
    with pytest.raises(ValueError, match="lacks avx512f"):
        kernel_build.isa_cap()
    monkeypatch.setenv("KESTREL_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="expected one of native, avx2, avx512"):
        kernel_build.isa_cap()


def test_refused_cap_makes_the_kernel_unavailable(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    monkeypatch.setattr(kernel_build, "_cpu_flags", lambda: "fpu avx")
    monkeypatch.setattr(kernel_build, "registered", lambda op: False)
    monkeypatch.setenv("KESTREL_CPU_ISA", "avx2")
    if kernel_build.compiler_missing() is not None:
        pytest.skip("no C++ compiler: the cap is never reached")
    with pytest.raises(kernel_build.KernelUnavailable, match="lacks avx2"):
        kernel_build.load_kernel.__wrapped__("paged_attention", str(tmp_path), "no_such_op")
