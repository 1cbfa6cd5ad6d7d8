"""The KV cache's memory budget: `--kv-cache-memory` (bytes or a fraction) or `--kv-cache-mb`.

    "2GiB" | "2147483648" | "0.3" ──parse_kv_memory──▶ bytes (int) | fraction (float) | None
      ──kv_budget(device, most)──▶ KVBudget (bytes, and why) handed to ModelRunner (which sizes
                                   the paged cache and logs the why)

Neither set (the default): AUTO_SHARE of the memory available, at most `most` (the bytes of
--max-num-seqs whole contexts of the model: more could never be used), as vLLM's
--gpu-memory-utilization takes a share of the device. On a CPU the cache's pages are mapped
zeroed and become the host's only as they are written (engine_worker/kv_cache.py), so a large
budget costs memory as it is used, not at start.

A fraction is of the memory available when the worker starts, before it loads weights: on CPU the
host's MemAvailable (/proc/meminfo), on CUDA the device's free memory (torch.cuda.mem_get_info).
Weights are not subtracted: the KV cache alone gets that share, so leave room for them.
No torch at import: the worker's config validates the spelling without it.
"""

from __future__ import annotations

import ctypes
import os
import re
from dataclasses import dataclass

UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
         "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "tb": 10**12}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_kv_memory(text: str) -> int | float | None:
    """None for "", a fraction for a plain number in (0, 1), else a byte count (>= 1)."""
    if not text.strip():
        return None
    m = _SIZE.match(text)
    if m is None or m.group(2).lower() not in UNITS:
        raise ValueError(f"kv_cache_memory must be bytes (e.g. 2147483648, 2GiB, 512MB) or a "
                         f"fraction in (0, 1), not {text!r}")
    number, unit = float(m.group(1)), m.group(2).lower()
    if not unit and 0 < number < 1:
        return number
    size = int(number * UNITS[unit])
    if size < 1:
        raise ValueError(f"kv_cache_memory must be positive, not {text!r}")
    return size


def available_bytes(device: str) -> int:
    """Memory free for the KV cache on `device` right now (see the module docstring)."""
    if device.startswith("cuda"):
        import torch

        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


AUTO_SHARE = 0.25  # of the memory available at start, when no budget is given


@dataclass(frozen=True)
class KVBudget:
    bytes: int
    why: str  # for the start log: where the figure came from


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def kv_budget(kv_cache_memory: str, kv_cache_mb: int, device: str,
              most: int | None = None) -> KVBudget:
    """kv_cache_memory when set, else kv_cache_mb MiB when set (> 0), else AUTO_SHARE of the
    memory available, capped at `most` bytes when given."""
    spec = parse_kv_memory(kv_cache_memory)
    if isinstance(spec, int):
        return KVBudget(spec, f"--kv-cache-memory {kv_cache_memory}")
    if isinstance(spec, float):
        free = available_bytes(device)
        return KVBudget(int(spec * free),
                        f"--kv-cache-memory {kv_cache_memory} of {_gib(free)} available")
    if kv_cache_mb > 0:
        return KVBudget(kv_cache_mb * 2**20, f"--kv-cache-mb {kv_cache_mb}")
    free = available_bytes(device)
    share = int(AUTO_SHARE * free)
    if most is not None and most < share:
        return KVBudget(most, f"every sequence's whole context, under {AUTO_SHARE:g} of the "
                              f"{_gib(free)} available")
    return KVBudget(share, f"{AUTO_SHARE:g} of the {_gib(free)} available")


def kv_budget_bytes(kv_cache_memory: str, kv_cache_mb: int, device: str,
                    most: int | None = None) -> int:
    """kv_budget's bytes alone."""
    return kv_budget(kv_cache_memory, kv_cache_mb, device, most).bytes


def trim_heap() -> None:
    """Give the host back the heap this process freed: glibc keeps it for reuse (after a GGUF's
    load, its rewrite's numpy temporaries, ~100 MB for a 0.5B file; after start-up, the parsed
    metadata and the Hello's tokenizer json, ~80 MiB for the 1.5B Qwen; after a burst, the
    steps' activations, ~180 MiB). A few ms. Not glibc (musl, macOS): nothing to do."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
