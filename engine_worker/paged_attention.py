"""The in-place paged decode attention kernel (issue 10): built once for this host, a torch op.

Data flow:

    load_paged_attention(mode, device, dtype, cache_dir)      once, when the runner starts
      -> mode "gather", a non-CPU device, a dtype other than float32/bfloat16, no C++ compiler
         or ninja, or a failed build: PagedAttention(enabled=False, reason) and one log line;
         the model keeps the gather path (a contiguous copy of each context, then SDPA)
      -> else <cache_dir>/kernels/paged_attention-<torch version>-<hash>/ (hash: source, flags,
         CPU features) holds the built library? load it (milliseconds). If not, log
         "compiling ... (one time, ~N s)" and build it there with torch.utils.cpp_extension
         (-O3 -march=native: this host's AVX512 or AVX2)
      -> the library registers torch.ops.kestrel.paged_decode_attention (C++, TORCH_LIBRARY);
         its fake (shape-only) implementation is registered here, so torch.compile traces it
    Attention's decode then calls `paged_decode_attention(q, k_cache, v_cache, table, lens, bs)`
    -> (B, H, D), reading K and V where they sit in the cache (csrc/paged_attention.cpp).

The source hash and torch version key the folder, so an edited kernel or another torch builds
anew and never loads a stale library; `-march=native` is safe because the host that builds is
the host that runs it: the key also hashes the CPU's feature flags, so a cache dir shared by
hosts with different CPUs builds once per kind of CPU.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger("kestrel.paged_attention")

SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
MODES = ("auto", "gather")
# -fopenmp: at::parallel_for is a header template that splits work with `omp parallel`; without
# it the kernel would run on one thread. It links libgomp.so.1, which torch has already loaded.
CFLAGS = ("-O3", "-march=native", "-fopenmp")
BUILD_SECONDS = 15  # the first build took 9 s on a shared 2-core host; the log line says ~15


@dataclass(frozen=True)
class PagedAttention:
    """Whether decode attention reads the cache in place, and if not, why not."""

    enabled: bool
    reason: str


def _cpu_flags() -> str:
    """This CPU's feature flags (Linux), so that a cache dir shared by hosts of different CPUs
    (a network volume) never hands an AVX512 build to an AVX2-only host."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine() + " " + platform.processor()


def _source_key() -> str:
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(" ".join(CFLAGS).encode())
    h.update(_cpu_flags().encode())
    return f"{torch.__version__.replace('+', '_')}-{h.hexdigest()[:16]}"


def build_dir(cache_dir: Path) -> Path:
    return Path(cache_dir) / "kernels" / f"paged_attention-{_source_key()}"


def compiler_missing() -> str | None:
    """Why the kernel cannot be built here (no C++ compiler or ninja), or None if it can."""
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx!r} not found)"
    from torch.utils.cpp_extension import is_ninja_available

    return None if is_ninja_available() else "ninja not found"


STALE_LOCK_S = 600  # a build lock this old was left by a killed build: torch would wait forever


def _loaded() -> bool:
    try:
        torch.ops.kestrel.paged_decode_attention  # noqa: B018 (raises if not registered)
    except (AttributeError, RuntimeError):
        return False
    return True


@cache
def _load(cache_dir: str) -> None:
    """Build (first time) and load the library, register its fake implementation. Once per
    process: the op registry is process-wide, and a second registration would raise."""
    if _loaded():
        return
    folder = build_dir(Path(cache_dir))
    lock = folder / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
        lock.unlink(missing_ok=True)
    name = f"kestrel_paged_attention_{_source_key().rsplit('-', 1)[1]}"
    lib = folder / f"{name}.so"
    if lib.is_file() and not lock.exists():
        torch.ops.load_library(str(lib))
    else:
        from torch.utils.cpp_extension import load

        log.info("compiling the paged attention kernel (one time, ~%d s) into %s",
                 BUILD_SECONDS, folder)
        t0 = time.monotonic()
        folder.mkdir(parents=True, exist_ok=True)
        # is_python_module=False: the .so only registers torch ops (torch.ops.load_library)
        load(name=name, sources=[str(SOURCE)], extra_cflags=list(CFLAGS),
             extra_ldflags=["-fopenmp"],
             build_directory=str(folder), is_python_module=False, verbose=False)
        log.info("paged attention kernel built in %.1f s", time.monotonic() - t0)

    @torch.library.register_fake("kestrel::paged_decode_attention")
    def _fake(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              block_table: torch.Tensor, context_lens: torch.Tensor,
              block_size: int) -> torch.Tensor:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)  # (B, H, D) contiguous


def load_paged_attention(mode: str, device: torch.device, dtype: torch.dtype,
                         cache_dir: Path) -> PagedAttention:
    """Load the kernel if it can serve this device and dtype; a clear reason when it cannot."""
    if mode not in MODES:
        raise ValueError(f"paged attention mode must be one of {MODES}, not {mode!r}")
    reason = None
    if mode == "gather":
        reason = "asked for (--paged-attention gather / KESTREL_PAGED_ATTENTION=gather)"
    elif torch.device(device).type != "cpu":
        reason = f"the kernel is CPU-only, the device is {device}"
    elif dtype not in (torch.float32, torch.bfloat16):
        reason = f"the kernel serves float32 and bfloat16 caches, not {dtype}"
    else:
        reason = compiler_missing()
    if reason is None:
        try:
            _load(str(cache_dir))
        except Exception as e:  # a failed build must not stop the worker: gather still works
            reason = f"the kernel failed to build or load: {type(e).__name__}: {e}"
    if reason is not None:
        log.info("decode attention gathers each context into a copy: %s", reason)
        return PagedAttention(False, reason)
    log.info("decode attention reads the paged KV cache in place (C++ kernel)")
    return PagedAttention(True, "in place")


def paged_decode_attention(
    q: torch.Tensor,  # (B, H, D), unit last stride
    k_cache: torch.Tensor,  # (slots, Hkv, D) contiguous
    v_cache: torch.Tensor,  # (slots, Hkv, D)
    block_table: torch.Tensor,  # (B, nblk) int64
    context_lens: torch.Tensor,  # (B,) int64
    block_size: int,
) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v over each sequence's first context_lens[b] positions, query
    head i on KV head i // (H / Hkv): (B, H, D) in q's dtype. Needs load_paged_attention first."""
    return torch.ops.kestrel.paged_decode_attention(
        q, k_cache, v_cache, block_table, context_lens, block_size
    )
