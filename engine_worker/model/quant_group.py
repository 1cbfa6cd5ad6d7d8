"""INT8 with one scale per group of 32 inputs (GGUF's Q8_0): a linear layer and an embedding.

Data flow: a Q8_0 tensor (N rows of K/32 blocks: fp16 scale d, 32 int8 codes q; w = d * q) ->
`Int8GroupLinear(codes (N, K) int8, scales (N, K/32))` -> forward `x (M, K) -> (M, N)`. A tied
embedding (`Int8GroupEmbedding`) reads the same buffers, so the LM head and the embedding of
SmolLM2 share one INT8 copy (28 MiB instead of 113 MiB of float32).

Codes are stored group-major, (G, N, 32): each group's codes are one contiguous (N, 32) matrix,
which is what torch's per-channel INT8 kernel (`_weight_int8pack_mm`) takes; row-major (N, K)
when the native kernel serves the layer. Kernels by rows:
  - few rows (decode, <= `dense_min_rows` - 1): one `_weight_int8pack_mm` per group with that
    group's scales as the per-channel scales, partial sums added in float32. Exact in the codes;
    reads 1 byte a weight.
  - many rows: a dense bfloat16 copy (2 bytes a weight, kept only when `dense_min_rows` is set)
    through oneDNN: per group the kernel above re-reads x, so at 16 rows it is ~4x slower.
  - fallback (other devices, float32 exact mode): dequantize, then F.linear.
  - native (where `load_group_gemv` built it): up to 8 rows, our C++ loop over row-major codes
    (csrc/group_gemv.cpp), which reads each byte once: ~1.5x torch's per-group kernel for the
    SmolLM2 head at one row, ~4x at two (measured, benchmarks/bench_group_gemv.py).
Which of these serves which row count is the layer's `routes` (model/matmul_plan.py), chosen
once at build; its forward looks the path up. Scales are kept in float32 (fp16 -> float32 is
exact), plus a bfloat16 copy for torch's kernel.
"""

from __future__ import annotations

import logging
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from engine_worker.kernel_build import KernelUnavailable, load_kernel
from engine_worker.model.matmul_plan import Route, default_routes, describe_routes
from engine_worker.model.routed_linear import RoutedLinear

log = logging.getLogger("kestrel.quant")

_INT8_MM = getattr(torch, "_weight_int8pack_mm", None)
GROUP = 32
NATIVE_MAX_ROWS = 8  # the C++ kernel's limit (csrc/group_gemv.cpp)


def load_group_gemv(cache_dir: Path) -> str | None:
    """Build/load the C++ few-row Q8_0 kernel (engine_worker/kernel_build.py) and register its
    shape-only implementation for torch.compile; None when ready, else why it is not (logged)."""
    try:
        load_kernel("group_gemv", str(cache_dir), "q8_group_mm")
    except KernelUnavailable as e:
        log.info("Q8_0 layers use torch's per-group INT8 kernel: %s", e)
        return str(e)
    _register_fake()
    return None


@cache
def _register_fake() -> None:
    @torch.library.register_fake("kestrel::q8_group_mm")
    def _fake(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return x.new_empty(x.shape[0], codes.shape[0])  # (M, N)


def q8_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0's own rule on a float (N, K) matrix: per group of 32, scale = max|w| / 127 (stored
    as float16, as a Q8_0 file would), codes = round(w / scale), rounded against the stored
    scale: (codes (N, K) int8, scales (N, K/32) float32)."""
    n, k = weight.shape
    if k % GROUP:
        raise ValueError(f"in_features {k} is not a multiple of {GROUP}")
    w = weight.detach().float().view(n, k // GROUP, GROUP)  # (N, G, 32)
    scales = (w.abs().amax(dim=-1) / 127).clamp(min=1e-12).half().float()  # (N, G)
    codes = torch.round(w / scales[..., None]).clamp(-127, 127).to(torch.int8).view(n, k)
    return codes, scales


class Int8GroupLinear(RoutedLinear):
    def __init__(self, codes: torch.Tensor, scales: torch.Tensor,
                 routes: tuple[Route, ...] | None = None,
                 bias: torch.Tensor | None = None) -> None:
        """codes (N, K) int8, scales (N, K/32) float; w[n, k] = codes[n, k] * scales[n, k//32];
        `bias` (N,), if any, added after the matmul in the output's dtype.
        `routes` (model/matmul_plan.py; default_routes without one): the path each row count
        takes. A "q8" route reads the codes row-major (our C++ kernel, loaded by the caller with
        `load_group_gemv`); otherwise they are kept group-major for torch's kernel. A "dense"
        route keeps a copy in its dtype; "int8_groups" and "dequantize" compute in theirs (a
        dequantize without one: in the activations' dtype, the exact mode)."""
        super().__init__()
        n, k = codes.shape
        if k % GROUP or scales.shape != (n, k // GROUP):
            raise ValueError(f"codes {tuple(codes.shape)} and scales {tuple(scales.shape)} "
                             f"do not form groups of {GROUP}")
        routes = default_routes("int8_groups", codes.device.type) if routes is None else routes
        dtypes = {r.path: getattr(torch, r.dtype) if r.dtype else None for r in routes}
        self.out_features, self.in_features, self.groups = n, k, k // GROUP
        self.native = "q8" in dtypes
        self.use_kernel = self.native or "int8_groups" in dtypes
        self.compute_dtype = dtypes.get("dequantize")  # None: the activations' dtype
        if self.native:  # row-major, as the C++ kernel reads them
            self.register_buffer("codes", codes.contiguous())  # (N, K)
            self.register_buffer("scales", scales.float().contiguous())  # (N, G) float32
            self.register_buffer("scales_kernel", None)
        else:  # group-major: each group's (N, 32) codes one matrix for torch's kernel
            g_codes = codes.view(n, self.groups, GROUP).transpose(0, 1).contiguous()  # (G, N, 32)
            self.register_buffer("codes", g_codes)
            self.register_buffer("scales", scales.float().t().contiguous())  # (G, N) float32
            kernel = dtypes.get("int8_groups")
            self.register_buffer("scales_kernel",
                                 None if kernel is None else self.scales.to(kernel))
        copy = dtypes.get("dense")
        self.register_buffer("dense", None if copy is None else self.dequantize(copy))
        self.register_buffer("bias", bias)
        self.set_routes(routes)

    @classmethod
    def from_float(cls, weight: torch.Tensor, *,
                   routes: tuple[Route, ...] | None = None) -> Int8GroupLinear:
        """q8_groups' codes as a layer. The INT4 mode's head: 1 byte a weight, ~2x the error
        of per-row INT8 spread over groups, and it keeps SmolLM2's Paris answer where per-row
        INT8 did not."""
        return cls(*q8_groups(weight), routes)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(N, K) weights: codes times their group's float32 scale, then cast."""
        n, k, g = self.out_features, self.in_features, self.groups
        if self.native:
            w = self.codes.view(n, g, GROUP).float() * self.scales[..., None]  # (N, G, 32)
            return w.view(n, k).to(dtype)
        w = self.codes.float() * self.scales[..., None]  # (G, N, 32)
        return w.transpose(0, 1).reshape(n, k).to(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` (n,) of the dequantized matrix: (n, K), for an embedding lookup."""
        if self.native:
            c = self.codes.index_select(0, ids).view(-1, self.groups, GROUP).float()  # (n,G,32)
            s = self.scales.index_select(0, ids)[..., None]  # (n, G, 1)
            return (c * s).view(ids.shape[0], self.in_features).to(dtype)
        c = self.codes.index_select(1, ids).float()  # (G, n, 32)
        s = self.scales.index_select(1, ids)[..., None]  # (G, n, 1)
        return (c * s).transpose(0, 1).reshape(ids.shape[0], self.in_features).to(dtype)

    def _q8(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float().contiguous()
        ys = [torch.ops.kestrel.q8_group_mm(xf[i : i + NATIVE_MAX_ROWS], self.codes, self.scales)
              for i in range(0, x.shape[0], NATIVE_MAX_ROWS)]  # (<=8, N) each
        return (ys[0] if len(ys) == 1 else torch.cat(ys)).to(x.dtype)  # (M, N)

    def _int8_groups(self, x: torch.Tensor) -> torch.Tensor:
        assert self.scales_kernel is not None
        m = x.shape[0]
        xg = x.to(self.scales_kernel.dtype).view(m, self.groups, GROUP).transpose(0, 1)
        xg = xg.contiguous()  # (G, M, 32)
        acc = torch.zeros(m, self.out_features, dtype=torch.float32, device=x.device)  # (M, N)
        for g in range(self.groups):  # (M, 32) @ (32, N) per group, scaled per output channel
            acc += _INT8_MM(xg[g], self.codes[g], self.scales_kernel[g])  # type: ignore[misc]
        return acc.to(x.dtype)

    def _dequantize(self, x: torch.Tensor) -> torch.Tensor:
        cd = self.compute_dtype or x.dtype  # one transient matrix
        return F.linear(x.to(cd), self.dequantize(cd)).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, group={GROUP}, "
                f"routes={describe_routes(self.routes)}")


class Int8GroupEmbedding(nn.Module):
    """An embedding that reads an Int8GroupLinear's rows (a tied LM head). No `weight`
    attribute on purpose: code that reads `embed_tokens.weight` must fail loudly."""

    def __init__(self, table: Int8GroupLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self.table = table
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.rows(ids, self.dtype)  # (N, C)
