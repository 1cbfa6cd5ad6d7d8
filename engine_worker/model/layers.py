"""The decoder's building blocks (model/llama.py): RoPE tables and rotation, a linear layer
through the fastest CPU kernel measured for its shape, and RMSNorm.

    positions -> rope_inv_freq (D/2,) -> cos/sin tables (the model's init_rope) -> apply_rope
    x (M, K) -> Linear / linear -> (M, N): oneDNN for several rows, a K-split bmm for one row,
                                   F.linear otherwise (and under torch.compile)
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from engine_worker.model.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies (D/2,) float32, with the checkpoint's theta and scaling."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    sc = cfg.rope_scaling
    if sc is None:
        return inv_freq
    if sc["rope_type"] == "linear":
        return inv_freq / float(sc["factor"])
    if sc["rope_type"] == "llama3":  # Llama 3.1: stretch low frequencies, keep high ones
        factor, lo = float(sc["factor"]), float(sc["low_freq_factor"])
        hi = float(sc["high_freq_factor"])
        old_ctx = float(sc["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / lo, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_ctx / hi) * ~(wavelen > old_ctx / lo)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported RoPE scaling {sc['rope_type']!r}")


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x (N, h, D) rotated; cos/sin_signed (N, 1, D). sin_signed = [-sin, sin] halves, so that
    rotate_half(x) * sin == cat(x2, x1) * sin_signed exactly, one negation fewer per call."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((x2, x1), dim=-1) * sin_signed


# CPU float32 matmuls. On the AMD hosts we serve from MKL's sgemv is single-threaded, ~11 GB/s.
# Measured faster, per SmolLM2 decode step (538 MB of weights):
#  - several rows (prefill, batched decode): oneDNN, ~1.5x MKL. An internal op (what
#    torch.compile emits for CPU linears), hence the fallback to F.linear where it is absent.
#  - one row (batch-1 decode) on a K-major weight: the K axis cut into `_k_splits` pieces run as
#    one bmm (a GEMV per thread), then summed: ~30 GB/s against oneDNN's ~21.
# Both cost ~15 us a call more than F.linear, so small weights (tiny test models) skip them.
_op = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
_ONEDNN = _op.default if _op is not None and torch.backends.mkldnn.is_available() else None
_FAST_MIN_NUMEL = 1 << 18  # 1 MiB of float32 weights


def _cpu_fast(w: torch.Tensor) -> bool:
    return (
        _ONEDNN is not None
        and w.dtype == torch.float32
        and w.device.type == "cpu"
        and w.numel() >= _FAST_MIN_NUMEL
    )


@lru_cache(maxsize=64)
def _k_splits(k: int, threads: int) -> int:
    """The most pieces (2..threads, at most 8) that cut K evenly; 1 if none does."""
    return next((s for s in range(min(threads, 8), 1, -1) if k % s == 0), 1)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) @ w (N, K)^T + bias -> (M, N), through the fastest kernel we know for the case."""
    if not _cpu_fast(w) or x.dtype != torch.float32 or torch.compiler.is_compiling():
        # compiled (engine_worker/compiled_step.py): Inductor picks the CPU kernel itself
        return F.linear(x, w, bias)
    n, k = w.shape
    s = _k_splits(k, torch.get_num_threads())
    if x.shape[0] == 1 and w.stride(0) == 1 and s > 1:  # (s, 1, K/s) @ (s, K/s, N), summed
        y = torch.bmm(x.view(s, 1, k // s), w.t().view(s, k // s, n)).sum(0)  # (1, N)
        return y if bias is None else y + bias
    return _ONEDNN(x, w, bias, "none", [], "")  # type: ignore[misc]


class Linear(nn.Linear):
    """nn.Linear (quantization swaps it like any other) through `linear`. `use_k_major` re-stores
    the weight as the transpose of an (in, out) tensor: same shape and values for every reader."""

    def use_k_major(self) -> None:
        if _cpu_fast(self.weight) and self.weight.stride(0) != 1:
            self.weight = nn.Parameter(self.weight.t().contiguous().t(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, kernel: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        # Where the matmul plan runs decode rows through the C++ decode stack (model/
        # decode_stack.py; the builder has loaded it): float32 CPU rows take its norm, so every
        # row of the model has one set of numerics.
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel and x.dtype == torch.float32 and not torch.compiler.is_compiling():
            return torch.ops.kestrel.rms_norm_rows(x, self.weight, self.eps)
        # One op instead of six. Statistics in float32 like the reference; float32 results match
        # it bit for bit, half precision within an ulp (it rounds once, after the scaling).
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
