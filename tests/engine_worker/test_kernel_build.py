"""Tests for engine_worker/kernel_build.py's ISA cap: KESTREL_CPU_ISA picks what our kernels are
built for (and so which build folder they load from), and refuses what this CPU lacks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine_worker import kernel_build

REPO = Path(__file__).resolve().parents[2]


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


def test_an_edited_header_keys_a_new_build(monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    """A kernel includes the csrc/*.h beside it (paged_attention.cpp: attention_math.h): an
    edit to a header must build anew, never load the library built before it."""
    csrc = tmp_path / "csrc"
    shutil.copytree(kernel_build.CSRC, csrc)
    assert (csrc / "attention_math.h").is_file()
    monkeypatch.setattr(kernel_build, "CSRC", csrc)
    before = (kernel_build.build_dir("paged_attention", tmp_path),
              kernel_build.prebuilt_lib("paged_attention", "avx2", tmp_path),
              kernel_build.sources_digest())
    with open(csrc / "attention_math.h", "a", encoding="utf-8") as f:
        f.write("\n// edited\n")
    after = (kernel_build.build_dir("paged_attention", tmp_path),
             kernel_build.prebuilt_lib("paged_attention", "avx2", tmp_path),
             kernel_build.sources_digest())
    assert all(a != b for a, b in zip(before, after, strict=True))


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


LOAD = """
import logging, sys
logging.basicConfig(level=logging.INFO)
from engine_worker import kernel_build as kb
try:
    kb.load_kernel("group_gemv", sys.argv[1], "q8_group_mm")
    print("LOADED")
except kb.KernelUnavailable as e:
    print("UNAVAILABLE", e)
"""


def _load_elsewhere(cache: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """load_kernel in a fresh process (by default with no C++ compiler: only the cached library
    can serve)."""
    env = {**os.environ, "CXX": "no-such-compiler-kestrel", "PYTHONPATH": str(REPO), **env}
    return subprocess.run([sys.executable, "-c", LOAD, str(cache)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture
def cached_copy(cache_dir: Path, tmp_path: Path) -> Path:
    """A copy of this session's group_gemv build (built here if need be) in a cache of its own."""
    if kernel_build.compiler_missing() is not None:
        pytest.skip("no C++ compiler: no kernel to cache")
    # In a fresh process: in this one the op may already be registered from another cache, and
    # then load_kernel builds nothing into this one (CI's capped run found the folder missing).
    built = _load_elsewhere(cache_dir, CXX=os.environ.get("CXX", "c++"))
    assert built.stdout.strip() == "LOADED", built.stderr[-2000:]
    src = kernel_build.build_dir("group_gemv", cache_dir)
    dst = kernel_build.build_dir("group_gemv", tmp_path)
    shutil.copytree(src, dst)
    return tmp_path


def test_a_sealed_cached_kernel_loads_without_a_compiler(cached_copy: Path) -> None:
    res = _load_elsewhere(cached_copy)
    assert res.returncode == 0 and res.stdout.strip() == "LOADED", res.stderr[-2000:]


def test_a_truncated_cached_kernel_is_refused_and_logged_not_a_crash(cached_copy: Path) -> None:
    [lib] = kernel_build.build_dir("group_gemv", cached_copy).glob("*.so")
    data = lib.read_bytes()
    lib.write_bytes(data[: len(data) // 2])  # as a full disk or a killed copy leaves it
    res = _load_elsewhere(cached_copy)
    assert res.returncode == 0, f"the worker died ({res.returncode}): {res.stderr[-2000:]}"
    assert res.stdout.startswith("UNAVAILABLE")  # no compiler here to rebuild it: the fallback
    assert "is unusable" in res.stderr and "bytes where" in res.stderr
    assert not lib.exists()  # removed, so that a start with a compiler rebuilds it


V4 = "avx2 fma f16c avx512f avx512bw avx512dq avx512vl"


@pytest.mark.parametrize(("flags", "cap", "levels"), [
    ("fpu avx avx2 fma f16c", "native", ["avx2"]),
    ("fpu avx avx2 fma f16c avx_vnni", "native", ["avxvnni", "avx2"]),
    (V4, "native", ["avx512", "avx2"]),
    (V4 + " avx512_vnni", "native", ["avx512vnni", "avx512", "avx2"]),
    (V4 + " avx512_vnni avx_vnni", "native", ["avx512vnni", "avx512", "avxvnni", "avx2"]),
    (V4 + " avx512_vnni avx512_bf16", "native", ["avx512bf16", "avx512vnni", "avx512", "avx2"]),
    (V4 + " avx512_vnni avx512_bf16", "avx512", ["avx512", "avx2"]),
    (V4 + " avx512_vnni", "avx2", ["avx2"]),  # the cap's own -march, nothing past it
    (V4 + " avx512_vnni", "avx512", ["avx512", "avx2"]),
    ("fp asimd", "native", []),
])
def test_portable_levels_follow_the_cpu_and_the_cap(monkeypatch: pytest.MonkeyPatch, flags: str,
                                                    cap: str, levels: list[str]) -> None:
    monkeypatch.setattr(kernel_build, "_cpu_flags", lambda: flags)
    monkeypatch.setenv("KESTREL_CPU_ISA", cap)
    assert kernel_build.portable_levels() == levels


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """group_gemv prebuilt, as the worker image's build stage does, for the best level this CPU
    runs (one compile: the order among levels is shown with a copy, below)."""
    if kernel_build.compiler_missing() is not None:
        pytest.skip("no C++ compiler: nothing to prebuild")
    levels = kernel_build.portable_levels()
    if not levels:
        pytest.skip("this CPU runs no prebuilt level (not x86-64-v3)")
    root = tmp_path_factory.mktemp("prebuilt")
    [built] = kernel_build.prebuild(root, levels=(levels[0],), names=("group_gemv",))
    assert built.is_file()
    return root, levels


def test_a_prebuilt_kernel_loads_without_a_compiler_at_the_best_level(
        prebuilt: tuple[Path, list[str]], tmp_path: Path) -> None:
    """What the worker image does: no compiler and an empty cache, the library of the best
    level this CPU runs is loaded."""
    root, levels = prebuilt
    res = _load_elsewhere(tmp_path / "cache", KESTREL_PREBUILT_KERNELS=str(root))
    assert res.returncode == 0 and res.stdout.strip() == "LOADED", res.stderr[-2000:]
    assert f"the prebuilt {levels[0]} library" in res.stderr
    assert not (tmp_path / "cache" / "kernels").exists()  # nothing compiled, nothing cached


def test_a_damaged_prebuilt_kernel_is_refused_and_the_next_level_served(
        prebuilt: tuple[Path, list[str]], tmp_path: Path) -> None:
    root, levels = prebuilt
    copy = tmp_path / "prebuilt"
    shutil.copytree(root, copy)
    best = kernel_build.prebuilt_lib("group_gemv", levels[0], copy)
    if len(levels) > 1:  # the next level down, planted as a copy of a library this CPU runs
        nxt = kernel_build.prebuilt_lib("group_gemv", levels[1], copy)
        nxt.parent.mkdir(parents=True)
        shutil.copy(best, nxt)
        kernel_build._seal(nxt)
    best.write_bytes(best.read_bytes()[:4096])  # as a full disk or a killed copy leaves it
    res = _load_elsewhere(tmp_path / "cache", KESTREL_PREBUILT_KERNELS=str(copy))
    assert res.returncode == 0, f"the worker died ({res.returncode}): {res.stderr[-2000:]}"
    assert "prebuilt group_gemv kernel" in res.stderr and "is unusable" in res.stderr
    if len(levels) > 1:
        assert res.stdout.strip() == "LOADED"
        assert f"the prebuilt {levels[1]} library" in res.stderr
    else:  # an AVX2-only host: nothing below, and no compiler: torch's fallback
        assert res.stdout.startswith("UNAVAILABLE")
