"""The KV cache's memory budget: `--kv-cache-memory` (bytes or a fraction) or `--kv-cache-mb`.

    "2GiB" | "2147483648" | "0.3" ──parse_kv_memory──▶ bytes (int) | fraction (float) | None
      ──kv_budget_bytes(device)──▶ bytes handed to ModelRunner (which sizes the paged cache)

A fraction is of the memory available when the worker starts, before it loads weights: on CPU the
host's MemAvailable (/proc/meminfo), on CUDA the device's free memory (torch.cuda.mem_get_info).
Weights are not subtracted: the KV cache alone gets that share, so leave room for them.
No torch at import: the worker's config validates the spelling without it.
"""

from __future__ import annotations

import ctypes
import os
import re

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


def kv_budget_bytes(kv_cache_memory: str, kv_cache_mb: int, device: str) -> int:
    """The budget in bytes: kv_cache_memory when set, else kv_cache_mb MiB."""
    spec = parse_kv_memory(kv_cache_memory)
    if spec is None:
        return kv_cache_mb * 2**20
    if isinstance(spec, float):
        return int(spec * available_bytes(device))
    return spec


def trim_heap() -> None:
    """Give the host back the heap this process freed: glibc keeps it for reuse (after a GGUF's
    load, its rewrite's numpy temporaries, ~100 MB for a 0.5B file; after start-up, the parsed
    metadata and the Hello's tokenizer json, ~80 MiB for the 1.5B Qwen; after a burst, the
    steps' activations, ~180 MiB). A few ms. Not glibc (musl, macOS): nothing to do."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
