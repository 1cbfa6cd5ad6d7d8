"""The integer-dot layers' packed weights in 2 MiB pages (Linux transparent huge pages).

    build_model (a GGUF on the CPU) -> adopt(model)
      -> where() says no (not Linux, THP "never"): nothing moves (--huge-pages off: not called)
      -> one anonymous map the size of every IntDotLinear's qs / d / m, 2 MiB aligned,
         madvise(MADV_HUGEPAGE) before a byte is written -> each tensor copied in (its file map
         dropped as it goes) -> the layers hold views of the map; the map lives as long as they do

Why: a one-row decode step streams every packed byte once (~1 GB for the 1.5B Qwen). Served
from the block cache's file maps they sit in 4 KiB pages, so the step walks ~250,000 page-table
entries and each page starts the hardware prefetcher anew; in 2 MiB pages the same bytes are
~500 entries. Measured on an AMD EPYC Zen 4 (2 vCPUs, THP "madvise"), a one-row step of the
1.5B Q4_K_M took 26.4 / 26.6 ms against 29.0 / 29.5 from the file maps (processes taking turns;
the same bytes copied into 4 KiB anonymous pages: 28.1 / 28.2), the 0.5B draft 10.2 against 10.8.

What it costs: the weights become the process's own memory, not file pages two workers of one
file share or the host can drop and read back (block_cache.py keeps the rewrite on disk either
way, so a later start still maps instead of packing). A step that streams them cannot afford
their eviction anyway, which is why vLLM loads weights into memory and llama.cpp has --no-mmap.
`--huge-pages off` (KESTREL_HUGE_PAGES=off) keeps the file maps.
"""

from __future__ import annotations

import logging
import mmap
import sys
from pathlib import Path

import torch
from torch import nn

from engine_worker import int_dot
from engine_worker.model.int_dot_linear import IntDotLinear

log = logging.getLogger("kestrel.model")

PAGE = 2 << 20  # a transparent huge page on x86-64 and most arm64 kernels
ALIGN = 64  # each tensor's start in the map: a cache line, as torch's allocator gives
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def where() -> str | None:
    """Why the weights stay where they are (None: they move to huge pages)."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return "no transparent huge pages on this platform"
    try:
        mode = THP_MODE.read_text()
    except OSError:
        return "no transparent huge pages in this kernel"
    if "[never]" in mode:
        return "transparent huge pages are off on this host ([never])"
    return None


def arena(nbytes: int) -> torch.Tensor:
    """A zeroed uint8 tensor of `nbytes` starting on a 2 MiB boundary, over an anonymous map
    advised MADV_HUGEPAGE before any page of it is touched (the tensor keeps the map alive)."""
    buf = mmap.mmap(-1, nbytes + PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(buf, dtype=torch.uint8)
    start = -whole.data_ptr() % PAGE
    return whole[start : start + nbytes]


def _layers(model: nn.Module) -> list[IntDotLinear]:
    return [m for m in model.modules() if isinstance(m, IntDotLinear)]


def _parts(p: int_dot.Packed) -> list[torch.Tensor]:
    return [t for t in (p.qs, p.d, p.m) if t is not None]


def _span(t: torch.Tensor) -> int:
    return -(-t.nbytes // ALIGN) * ALIGN


def adopt(model: nn.Module) -> int:
    """Move every integer-dot layer's packed tensors of `model` (on the CPU) into one huge-page
    map; the bytes moved (0 where `where()` says why not, logged). Values and shapes are kept,
    so every result is the same bits."""
    layers = _layers(model)
    total = sum(_span(t) for m in layers for t in _parts(m.packed))
    if not total:
        return 0
    why = where()
    if why is not None:
        log.info("packed weights stay in the block cache's file maps: %s", why)
        return 0
    room = arena(total)
    at = 0

    def place(t: torch.Tensor) -> torch.Tensor:
        nonlocal at
        view = room[at : at + t.nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        at += _span(t)
        return view

    for m in layers:
        p = m.packed
        m.packed = p._replace(qs=place(p.qs), d=place(p.d),
                              m=None if p.m is None else place(p.m))
    log.info("packed weights: %.1f MB copied into 2 MiB pages (--huge-pages off keeps the "
             "file maps)", total / 1e6)
    return total


def backing(t: torch.Tensor) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding `t`'s first byte ({} where there is
    no such file): "VmFlags" holds "hg" where the map was advised MADV_HUGEPAGE, and
    "AnonHugePages" the kB of it in huge pages (for tests and benchmarks)."""
    addr = t.data_ptr()
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return {}
    fields: dict[str, str] | None = None
    for line in text.splitlines():
        head, _, rest = line.partition(" ")
        if not head.endswith(":"):  # a mapping's first line: lo-hi perms offset dev inode path
            if fields is not None:
                return fields
            lo, _, hi = head.partition("-")
            fields = {} if int(lo, 16) <= addr < int(hi, 16) else None
        elif fields is not None:
            fields[head[:-1]] = rest.strip()
    return fields or {}
