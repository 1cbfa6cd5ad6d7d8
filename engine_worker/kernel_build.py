"""Building our C++ CPU kernels once per host and loading them as torch ops.

Data flow of `load_kernel(name, cache_dir)`:

    engine_worker/csrc/<name>.cpp (registers torch.ops.kestrel.* with TORCH_LIBRARY_FRAGMENT)
      -> its op already registered in this process? done
      -> why it cannot be built here (no C++ compiler, no ninja)? -> KernelUnavailable(reason)
      -> <cache_dir>/kernels/<name>-<torch version>-<hash of source and flags>/<lib>.so exists?
         load it (milliseconds)
      -> else log "compiling the <name> kernel (one time, ~N s)", build it there with
         torch.utils.cpp_extension (-O3 -march=native: this host's AVX512 or AVX2), load it

The source hash, the flags, torch's version and this CPU's feature flags key the folder, so an
edited kernel or another torch builds anew and never loads a stale library, and a cache dir shared
by hosts of different CPUs (a network volume) never hands an AVX512 build to an AVX2-only host:
`-march=native` builds for the host that builds. Every caller keeps a pure-torch fallback for
when this raises.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import time
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger("kestrel.kernels")

CSRC = Path(__file__).parent / "csrc"
# -fopenmp: at::parallel_for is a header template that splits work with `omp parallel`; without
# it a kernel runs on one thread. It links libgomp.so.1, which torch has already loaded.
CFLAGS = ("-O3", "-march=native", "-fopenmp")
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


def _source_key(name: str) -> str:
    h = hashlib.sha256((CSRC / f"{name}.cpp").read_bytes())
    h.update(" ".join(CFLAGS).encode())
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
    why = compiler_missing()
    if why is not None:
        raise KernelUnavailable(why)
    folder = build_dir(name, Path(cache_dir))
    lock = folder / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
        lock.unlink(missing_ok=True)
    lib_name = f"kestrel_{name}_{_source_key(name).rsplit('-', 1)[1]}"
    lib = folder / f"{lib_name}.so"
    try:
        if lib.is_file() and not lock.exists():
            torch.ops.load_library(str(lib))
            return
        from torch.utils.cpp_extension import load

        log.info("compiling the %s kernel (one time, ~%d s) into %s", name, seconds, folder)
        t0 = time.monotonic()
        folder.mkdir(parents=True, exist_ok=True)
        # is_python_module=False: the .so only registers torch ops (torch.ops.load_library)
        load(name=lib_name, sources=[str(CSRC / f"{name}.cpp")], extra_cflags=list(CFLAGS),
             extra_ldflags=["-fopenmp"], build_directory=str(folder), is_python_module=False,
             verbose=False)
        log.info("%s kernel built in %.1f s", name, time.monotonic() - t0)
    except Exception as e:  # a failed build must not stop the worker: the fallback still works
        raise KernelUnavailable(f"the {name} kernel failed to build or load: "
                                f"{type(e).__name__}: {e}") from e
