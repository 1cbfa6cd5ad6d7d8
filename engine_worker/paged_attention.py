"""The in-place paged decode attention kernel (issue 10): built once for this host, a torch op.

Data flow:

    load_paged_attention(mode, device, dtype, cache_dir)      once, when the runner starts
      -> mode "gather", a non-CPU device, a dtype other than float32/bfloat16, no C++ compiler
         or ninja, or a failed build: PagedAttention(enabled=False, reason) and one log line;
         the model keeps the gather path (a contiguous copy of each context, then SDPA)
      -> else engine_worker/kernel_build.py loads the library built for this host and torch
         under <cache_dir>/kernels/ (milliseconds), building it there the first time (logged:
         "compiling the paged_attention kernel (one time, ~15 s)")
      -> the library registers torch.ops.kestrel.paged_decode_attention (C++);
         its fake (shape-only) implementation is registered here, so torch.compile traces it
    Attention's decode then calls `paged_decode_attention(q, k_cache, v_cache, table, lens, bs)`
    -> (B, H, D) in q's dtype, reading K and V where they sit in the cache, in the cache's own
    dtype (float32, bfloat16, float16, or int8 / fp8 codes with their scales;
    csrc/paged_attention.cpp, engine_worker/kv_cache.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from engine_worker.kernel_build import KernelUnavailable, load_kernel

log = logging.getLogger("kestrel.paged_attention")

MODES = ("auto", "gather")
BUILD_SECONDS = 15  # the first build took 9 s on a shared 2-core host; the log line says ~15


@dataclass(frozen=True)
class PagedAttention:
    """Whether decode attention reads the cache in place, and if not, why not."""

    enabled: bool
    reason: str


def _load(cache_dir: str) -> None:
    """Build (first time on this host) and load the library, register its fake implementation."""
    load_kernel("paged_attention", cache_dir, "paged_decode_attention", BUILD_SECONDS)
    _register_fake()


@cache
def _register_fake() -> None:
    """Once per process (the op registry is process-wide; a second registration would raise),
    whichever cache dir the library came from."""

    @torch.library.register_fake("kestrel::paged_decode_attention")
    def _fake(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              block_table: torch.Tensor, context_lens: torch.Tensor,
              block_size: int) -> torch.Tensor:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)  # (B, H, D) contiguous


def load_paged_attention(mode: str, device: torch.device, dtype: torch.dtype,
                         cache_dir: Path, kv_dtype: torch.dtype | None = None) -> PagedAttention:
    """Load the kernel if it can serve this device, activation dtype and cache dtype
    (`kv_dtype`, default `dtype`); a clear reason when it cannot."""
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    if mode not in MODES:
        raise ValueError(f"paged attention mode must be one of {MODES}, not {mode!r}")
    reason = None
    if mode == "gather":
        reason = "asked for (--paged-attention gather / KESTREL_PAGED_ATTENTION=gather)"
    elif torch.device(device).type != "cpu":
        reason = f"the kernel is CPU-only, the device is {device}"
    elif dtype not in (torch.float32, torch.bfloat16):
        reason = f"the kernel serves float32 and bfloat16 activations, not {dtype}"
    elif kv_dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.int8,
                          torch.float8_e4m3fn):
        reason = f"the kernel serves float32, 16-bit and 8-bit caches, not {kv_dtype}"
    if reason is None:  # a cached or prebuilt library serves without a compiler
        try:
            _load(str(cache_dir))
        except KernelUnavailable as e:  # a failed build must not stop the worker: gather works
            reason = str(e)
    if reason is not None:
        log.info("decode attention gathers each context into a copy: %s", reason)
        return PagedAttention(False, reason)
    log.info("decode attention reads the paged KV cache in place (C++ kernel)")
    return PagedAttention(True, "in place")


def bf16_dot() -> bool:
    """Whether the loaded kernel reads a bfloat16 cache by vdpbf16ps (built where the host has
    AVX512-BF16 and KESTREL_CPU_ISA does not cap it away) rather than widening it to float32
    (load_paged_attention first)."""
    return torch.ops.kestrel.paged_attention_bf16_dot()


def paged_decode_attention(
    q: torch.Tensor,  # (B, H, D), unit last stride
    k_cache: torch.Tensor,  # (Hkv, slots, W) contiguous: W = D, or an 8-bit cache's row
    v_cache: torch.Tensor,  # (Hkv, slots, W)
    block_table: torch.Tensor,  # (B, nblk) int64
    context_lens: torch.Tensor,  # (B,) int64
    block_size: int,
) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v over each sequence's first context_lens[b] positions, query
    head i on KV head i // (H / Hkv): (B, H, D) in q's dtype. Needs load_paged_attention first."""
    return torch.ops.kestrel.paged_decode_attention(
        q, k_cache, v_cache, block_table, context_lens, block_size
    )
