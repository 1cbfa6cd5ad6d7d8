"""Building our C++ CPU kernels once per host and loading them as torch ops.

Data flow of `load_kernel(name, cache_dir)`:

    engine_worker/csrc/<name>.cpp (registers torch.ops.kestrel.* with TORCH_LIBRARY_FRAGMENT;
      it may include the csrc/*.h beside it)
      -> its op already registered in this process? done
      -> <cache_dir>/kernels/<name>-<torch version>-<hash of source and flags>/<lib>.so exists
         with the size and sha256 recorded at its build (<lib>.sha256)? load it (milliseconds);
         damaged or unrecorded: logged, deleted, rebuilt
      -> a prebuilt library for a portable level this CPU runs, in $KESTREL_PREBUILT_KERNELS
         (what the worker image ships: built for x86-64-v4 and -v3, with and without VNNI, and
         x86-64-v4 with VNNI and BF16, in its build stage, where the compiler stays)? load it,
         best level first
      -> why it cannot be built here (no C++ compiler, no ninja)? -> KernelUnavailable(reason)
      -> else log "compiling the <name> kernel (one time, ~N s)", build it there with
         torch.utils.cpp_extension (-O3 -march=native: this host's AVX512 or AVX2, or the
         level KESTREL_CPU_ISA caps it to), load it

The source hash (the .cpp and every csrc/*.h), the flags, torch's version and this CPU's feature
flags key the folder, so an edited kernel or another torch builds anew and never loads a stale
library, and a cache dir shared by hosts of different CPUs (a network volume) never hands an
AVX512 build to an AVX2-only host: `-march=native` builds for the host that builds. Every caller
keeps a pure-torch fallback for when this raises.

KESTREL_CPU_ISA caps the instructions our kernels may use, as ATEN_CPU_CAPABILITY and
ONEDNN_MAX_CPU_ISA cap torch's and oneDNN's: `avx2` builds for x86-64-v3 (AVX2, FMA, F16C),
`avx512` for x86-64-v4 (AVX512 F/BW/DQ/VL), `native` (the default) for this CPU. An AVX512
machine so proves the path an AVX2 host runs; a cap above what this CPU has is refused. The cap
bounds the prebuilt levels too: under `avx2` an x86-64-v4 library is never loaded.

`python -m engine_worker.kernel_build --prebuild DIR` builds every kernel for the portable
levels into DIR without loading any (a build host need not run what it builds for).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import time
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger("kestrel.kernels")

CSRC = Path(__file__).parent / "csrc"
# -fopenmp: at::parallel_for is a header template that splits work with `omp parallel`; without
# it a kernel runs on one thread. It links libgomp.so.1, which torch has already loaded.
CFLAGS = ("-O3", "-fopenmp")
# KESTREL_CPU_ISA -> (the -march it builds for, the CPU flags that level needs)
ISA_LEVELS: dict[str, tuple[str, tuple[str, ...]]] = {
    "native": ("native", ()),
    "avx2": ("x86-64-v3", ("avx2", "fma", "f16c")),
    "avx512": ("x86-64-v4", ("avx512f", "avx512bw", "avx512dq", "avx512vl")),
}
# The levels a prebuilt library is built for, best first: name -> (its flags, the CPU flags it
# needs). The VNNI levels matter: int_dot's dot products use VNNI where the build has it (Zen 4
# and 5, Ice Lake and later; AVX-VNNI on Alder Lake), and a plain x86-64-v4 build measured
# 1.24x the ITL of a -march=native one at 16 streams on a Zen 5 EPYC.
PORTABLE: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # AVX512-BF16 too (Zen 4 and 5, Cooper Lake, Sapphire Rapids): paged_attention's vdpbf16ps
    # path over a bfloat16 cache (csrc/attention_math.h), 0.6x the float32 path's time
    "avx512bf16": (("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16"),
                   (*ISA_LEVELS["avx512"][1], "avx512_vnni", "avx512_bf16")),
    "avx512vnni": (("-march=x86-64-v4", "-mavx512vnni"),
                   (*ISA_LEVELS["avx512"][1], "avx512_vnni")),
    "avx512": (("-march=x86-64-v4",), ISA_LEVELS["avx512"][1]),
    "avxvnni": (("-march=x86-64-v3", "-mavxvnni"), (*ISA_LEVELS["avx2"][1], "avx_vnni")),
    "avx2": (("-march=x86-64-v3",), ISA_LEVELS["avx2"][1]),
}
# KESTREL_CPU_ISA -> the prebuilt levels it allows: those its own build's -march covers
CAPPED_LEVELS = {"native": tuple(PORTABLE), "avx512": ("avx512", "avx2"), "avx2": ("avx2",)}
PREBUILT_ENV = "KESTREL_PREBUILT_KERNELS"
STALE_LOCK_S = 600  # a build lock this old was left by a killed build: torch would wait forever


class KernelUnavailable(RuntimeError):
    """A kernel cannot be built or loaded here; the message says why."""


def _cpu_flags() -> str:
    """This CPU's feature flags (Linux), or what the platform module says elsewhere."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine() + " " + platform.processor()


def isa_cap() -> str:
    """KESTREL_CPU_ISA, checked: one of ISA_LEVELS that this CPU has (ValueError otherwise)."""
    cap = os.environ.get("KESTREL_CPU_ISA", "native").strip().lower() or "native"
    if cap not in ISA_LEVELS:
        raise ValueError(f"KESTREL_CPU_ISA={cap!r}: expected one of {', '.join(ISA_LEVELS)}")
    missing = [f for f in ISA_LEVELS[cap][1] if f not in _cpu_flags().split()]
    if missing:
        raise ValueError(f"KESTREL_CPU_ISA={cap}: this CPU lacks {', '.join(missing)}")
    return cap


def cflags() -> tuple[str, ...]:
    return (*CFLAGS, f"-march={ISA_LEVELS[isa_cap()][0]}")


def portable_levels() -> list[str]:
    """The prebuilt levels this CPU runs within the cap, best first."""
    flags = set(_cpu_flags().split())
    return [lvl for lvl in CAPPED_LEVELS[isa_cap()] if flags.issuperset(PORTABLE[lvl][1])]


def prebuilt_lib(name: str, level: str, root: Path) -> Path:
    """Where a library of csrc/<name>.cpp built for a portable level lies under root: keyed by
    the source, the flags and torch's version, never by the building CPU."""
    h = hashlib.sha256(source_bytes(name))
    h.update(" ".join((*CFLAGS, *PORTABLE[level][0])).encode())
    tag = f"{torch.__version__.replace('+', '_')}-{level}-{h.hexdigest()[:16]}"
    return Path(root) / f"{name}-{tag}" / f"kestrel_{name}_{level}.so"


def _load_prebuilt(name: str) -> str | None:
    """Load the best prebuilt library of this kernel this CPU runs; its level, or None."""
    root = os.environ.get(PREBUILT_ENV)
    if not root:
        return None
    for level in portable_levels():
        lib = prebuilt_lib(name, level, Path(root))
        if not lib.is_file():
            continue
        damage = _check(lib)
        if damage is None:
            try:
                torch.ops.load_library(str(lib))
                log.info("%s kernel: the prebuilt %s library %s", name, level, lib)
                return level
            except Exception as e:
                damage = f"{type(e).__name__}: {e}"
        log.warning("the prebuilt %s kernel %s is unusable (%s)", name, lib, damage)
    return None


def prebuild(root: Path, levels: tuple[str, ...] = tuple(PORTABLE),
             names: tuple[str, ...] | None = None) -> list[Path]:
    """Compile every kernel (or those named) for each level into root with this host's compiler,
    loading none; each library sealed as load_kernel's own builds are. The paths written."""
    from torch.utils.cpp_extension import TORCH_LIB_PATH, include_paths

    cxx = os.environ.get("CXX", "c++")
    written = []
    for src in sorted(CSRC.glob("*.cpp")):
        if names is not None and src.stem not in names:
            continue
        for level in levels:
            lib = prebuilt_lib(src.stem, level, root)
            lib.parent.mkdir(parents=True, exist_ok=True)
            tmp = lib.with_suffix(f".{os.getpid()}.tmp")
            cmd = [cxx, str(src), "-shared", "-fPIC", "-std=c++20", *CFLAGS,
                   *PORTABLE[level][0], "-DTORCH_API_INCLUDE_EXTENSION_H",
                   f"-DTORCH_EXTENSION_NAME=kestrel_{src.stem}_{level}",
                   *(f"-isystem{d}" for d in include_paths("cpu")), f"-L{TORCH_LIB_PATH}",
                   "-lc10", "-ltorch_cpu", "-ltorch", "-o", str(tmp)]
            t0 = time.monotonic()
            subprocess.run(cmd, check=True)
            tmp.replace(lib)
            _seal(lib)
            log.info("built %s for %s in %.1f s", lib, level, time.monotonic() - t0)
            written.append(lib)
    return written


def sources_digest() -> str:
    """A digest of every kernel's source (csrc/*.cpp and *.h): what a record of measured step
    costs is keyed by beside the host, since an edited kernel changes what a step costs."""
    h = hashlib.sha256()
    for src in sorted((*CSRC.glob("*.cpp"), *CSRC.glob("*.h"))):
        h.update(src.name.encode() + b"\0" + src.read_bytes())
    return h.hexdigest()[:16]


def source_bytes(name: str) -> bytes:
    """csrc/<name>.cpp and every header beside it (csrc/*.h), which a kernel may include: what
    keys its build, so an edited header rebuilds the kernels."""
    parts = [CSRC / f"{name}.cpp", *sorted(CSRC.glob("*.h"))]
    return b"".join(src.name.encode() + b"\0" + src.read_bytes() for src in parts)


def _source_key(name: str) -> str:
    h = hashlib.sha256(source_bytes(name))
    h.update(" ".join(cflags()).encode())
    h.update(_cpu_flags().encode())
    return f"{torch.__version__.replace('+', '_')}-{h.hexdigest()[:16]}"


def build_dir(name: str, cache_dir: Path) -> Path:
    return Path(cache_dir) / "kernels" / f"{name}-{_source_key(name)}"


def compiler_missing() -> str | None:
    """Why no kernel can be built here (no C++ compiler or ninja), or None if one can."""
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx!r} not found)"
    from torch.utils.cpp_extension import is_ninja_available

    return None if is_ninja_available() else "ninja not found"


def registered(op: str) -> bool:
    """Whether torch.ops.kestrel.<op> is registered in this process."""
    try:
        getattr(torch.ops.kestrel, op)
    except (AttributeError, RuntimeError):
        return False
    return True


@cache
def load_kernel(name: str, cache_dir: str, op: str, seconds: int = 15) -> None:
    """Build (first time on this host) and load csrc/<name>.cpp, which registers
    torch.ops.kestrel.<op>; raise KernelUnavailable with the reason if that cannot be done.
    Once per process: the op registry is process-wide (a second library registering the same op,
    say from another cache dir, would raise), so an op already there is left as it is."""
    if registered(op):
        return
    try:
        flags = cflags()
    except ValueError as e:
        raise KernelUnavailable(str(e)) from e
    folder = build_dir(name, Path(cache_dir))
    lock = folder / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
        lock.unlink(missing_ok=True)
    lib_name = f"kestrel_{name}_{_source_key(name).rsplit('-', 1)[1]}"
    lib = folder / f"{lib_name}.so"
    if lib.is_file() and not lock.exists():
        damage = _check(lib)
        if damage is None:
            try:
                torch.ops.load_library(str(lib))
                return
            except Exception as e:  # an intact file that still does not load: rebuild it
                damage = f"{type(e).__name__}: {e}"
        log.warning("the cached %s kernel %s is unusable (%s): rebuilding it", name, lib, damage)
        for stale in folder.iterdir():  # ninja would see the .so newer than its source
            if stale.name != "lock":
                stale.unlink(missing_ok=True)
    if _load_prebuilt(name) is not None:
        return
    why = compiler_missing()
    if why is not None:
        raise KernelUnavailable(why)
    try:
        from torch.utils.cpp_extension import load

        log.info("compiling the %s kernel for %s (one time, ~%d s) into %s", name, flags[-1],
                 seconds, folder)
        t0 = time.monotonic()
        folder.mkdir(parents=True, exist_ok=True)
        # is_python_module=False: the .so only registers torch ops (torch.ops.load_library)
        load(name=lib_name, sources=[str(CSRC / f"{name}.cpp")], extra_cflags=list(flags),
             extra_ldflags=["-fopenmp"], build_directory=str(folder), is_python_module=False,
             verbose=False)
        _seal(lib)
        log.info("%s kernel built in %.1f s", name, time.monotonic() - t0)
    except Exception as e:  # a failed build must not stop the worker: the fallback still works
        raise KernelUnavailable(f"the {name} kernel failed to build or load: "
                                f"{type(e).__name__}: {e}") from e


def _digest(lib: Path) -> str:
    return hashlib.sha256(lib.read_bytes()).hexdigest()


def _seal(lib: Path) -> None:
    """Record the built library's size and hash beside it: what a later start must find."""
    seal = lib.with_suffix(".sha256")
    tmp = seal.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(f"{lib.stat().st_size} {_digest(lib)}\n")
    tmp.replace(seal)


def _check(lib: Path) -> str | None:
    """Why the cached library must not be loaded (None: it is the one that was built). A
    truncated .so is mapped past its end by the loader and kills the process with SIGBUS, with
    no Python error to catch: so it is checked before, never after."""
    try:
        size, digest = lib.with_suffix(".sha256").read_text().split()
    except (OSError, ValueError):
        return "no record of its size and hash"
    if lib.stat().st_size != int(size):
        return f"{lib.stat().st_size} bytes where {size} were built"
    if _digest(lib) != digest:
        return "its hash differs from the build's"
    return None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m engine_worker.kernel_build",
                                 description="Build our kernels for portable CPU levels.")
    ap.add_argument("--prebuild", type=Path, required=True, metavar="DIR",
                    help=f"where to write them (what {PREBUILT_ENV} names at run time)")
    ap.add_argument("--levels", default=",".join(PORTABLE),
                    help=f"comma-separated, of {', '.join(PORTABLE)}")
    args = ap.parse_args(argv)
    levels = tuple(lvl.strip() for lvl in args.levels.split(",") if lvl.strip())
    unknown = [lvl for lvl in levels if lvl not in PORTABLE]
    if unknown:
        ap.error(f"unknown level(s) {', '.join(unknown)}: expected {', '.join(PORTABLE)}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if platform.machine().lower() not in ("x86_64", "amd64"):  # the levels are x86-64's
        log.info("no prebuilt kernels for %s: the worker builds its own where it can",
                 platform.machine())
        return
    prebuild(args.prebuild, levels)


if __name__ == "__main__":
    main()
