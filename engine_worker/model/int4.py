"""INT4 weights, asymmetric per group of inputs, two to a byte (engine_worker/model/quant.py
swaps them in; GGUF Q4_0/Q4_1 blocks adopt the same layout with no rounding).

    x (M, K) --Int4GroupLinear--> (M, N): by its routes (model/matmul_plan.py): torch's packed
                                          int4 matmul on CPU (tiled bytes, bfloat16
                                          activations), a dense copy from some rows up, or
                                          dequantize + F.linear
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine_worker.model.matmul_plan import Route, default_routes, describe_routes, routes_dtype
from engine_worker.model.routed_linear import RoutedLinear

_INT4_PACK = getattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu", None)
_INT4_MM = getattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", None)
TILED_GROUPS = (32, 64, 128, 256)  # the group sizes torch's CPU kernel tiles (and N % 16 == 0)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(N, K) ints in 0..15 -> (N, K/2) uint8: column 2j in the low nibble, 2j+1 in the high."""
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4: (N, K/2) uint8 -> (N, K) uint8."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).view(packed.shape[0], -1)


class Int4GroupLinear(RoutedLinear):
    """Asymmetric INT4 per group of `group_size` inputs: w ~= (q - 8) * scale + zero, q in
    0..15, with scale = (max - min) / 15 and zero = min + 8 * scale per (row, group): the
    layout torch's int4 kernels read. Two weights a byte plus a scale and a zero per group.

    `qweight` is (N, K/2) uint8 either way; where the routes run torch's kernel its bytes are
    in the kernel's own tiled order (made by `_convert_weight_to_int4pack_for_cpu`,
    CPU-specific), otherwise in `pack_int4` order. `scales_zeros` is (K/G, N, 2), the kernel's
    layout. `routes` (model/matmul_plan.py): which path each row count takes; a "dense" route
    reads `dense`, an (N, K) copy in its dtype (2 or 4 bytes a weight beside the half byte)."""

    def __init__(
        self, qweight: torch.Tensor, scales_zeros: torch.Tensor, group_size: int,
        bias: torch.Tensor | None, routes: tuple[Route, ...], dense: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape[0], qweight.shape[1] * 2
        self.group_size = group_size
        self.register_buffer("qweight", qweight)  # (N, K/2) uint8
        self.register_buffer("scales_zeros", scales_zeros)  # (K/G, N, 2) compute dtype
        self.register_buffer("bias", bias)
        self.use_kernel = any(r.path == "int4" for r in routes)  # the bytes' layout
        if any(r.path == "dense" for r in routes) != (dense is not None):
            raise ValueError("a dense route needs its copy, and a copy its route")
        self.register_buffer("dense", dense)  # (N, K)
        self.set_routes(routes)

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, bias: torch.Tensor | None = None, *, group_size: int = 32,
        routes: tuple[Route, ...] | None = None, clip_search: bool = False,
    ) -> Int4GroupLinear:
        """int4_groups' codes as a layer (routes: default_routes for the matrix's device)."""
        n = weight.shape[0]
        if routes is None:
            routes = default_routes("int4", weight.device.type,
                                    fits=n % 16 == 0 and group_size in TILED_GROUPS)
        q, scale, zero = int4_groups(weight, group_size, routes_dtype(routes) or weight.dtype,
                                     clip_search)
        return cls.from_codes(q, scale, zero, group_size, bias, routes=routes)

    @classmethod
    def from_codes(
        cls, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
        bias: torch.Tensor | None = None, *, routes: tuple[Route, ...],
        weight: torch.Tensor | None = None,
    ) -> Int4GroupLinear:
        """Adopt ready codes: q (N, K) in 0..15, scale and zero (N, K/G) in the compute dtype,
        meaning w = (q - 8) * scale + zero. GGUF Q4_0/Q4_1 blocks map here with no rounding.
        `weight` (N, K), when the caller has it, makes a dense route's copy without reading the
        tiled bytes back through the float32 kernel (seconds per layer)."""
        if any(r.path == "int4" for r in routes):
            packed = _INT4_PACK(q.to(torch.int32), 1)  # (N, K/2) uint8, tiled
        else:
            packed = pack_int4(q)
        sz = torch.stack((scale, zero), dim=-1).transpose(0, 1).contiguous()  # (K/G, N, 2)
        layer = cls(packed, sz, group_size, None if bias is None else bias.detach().clone(),
                    tuple(r for r in routes if r.path != "dense"))
        dense = next((r for r in routes if r.path == "dense"), None)
        if dense is None:
            return layer
        w = layer.dequantize(torch.float32) if weight is None else weight
        return cls(layer.qweight, sz, group_size, layer.bias, routes,
                   w.to(getattr(torch, dense.dtype)))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(N, K) weights in `dtype`."""
        n, k, g = self.out_features, self.in_features, self.group_size
        if self.use_kernel:  # tiled bytes: read them back through the kernel, x = identity
            eye = torch.eye(k, dtype=torch.float32, device=self.qweight.device)
            sz = self.scales_zeros.float()
            return _INT4_MM(eye, self.qweight, g, sz).t().to(dtype)  # (K, N) -> (N, K)
        q = unpack_int4(self.qweight).to(dtype).view(n, k // g, g)  # (N, K/G, G)
        sz = self.scales_zeros.transpose(0, 1).to(dtype)  # (N, K/G, 2)
        return ((q - 8) * sz[..., :1] + sz[..., 1:]).view(n, k)

    def _int4(self, x: torch.Tensor) -> torch.Tensor:
        xc = x.to(self.scales_zeros.dtype)
        return _INT4_MM(xc, self.qweight, self.group_size, self.scales_zeros).to(x.dtype)

    def _dequantize(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantize(x.dtype))

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, group={self.group_size}, "
                f"routes={describe_routes(self.routes)}")


CLIP_SHRINKS = (0.95, 0.9, 0.85, 0.8, 0.75, 0.7)


def int4_groups(weight: torch.Tensor, group_size: int, compute_dtype: torch.dtype,
                clip_search: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The INT4 rule over a float (N, K) matrix: codes (N, K) in 0..15, scale and zero (N, K/G)
    in compute_dtype. Round-to-nearest over each group's [min, max]; with clip_search, each
    group also tries ranges shrunk by CLIP_SHRINKS and keeps the one with the least squared
    error (an outlier then costs one clipped weight instead of a coarse step for all 32)."""
    n, k = weight.shape
    if k % group_size or k % 2:
        raise ValueError(f"in_features {k} is not a multiple of group size {group_size}")
    w = weight.detach().float().view(n, k // group_size, group_size)  # (N, K/G, G)
    q, scale, zero = _round_groups(w, w.amin(-1), w.amax(-1), compute_dtype)
    if clip_search:  # per group, the clipped range with the least squared error
        best = ((_dequant_groups(q, scale, zero) - w) ** 2).sum(-1)  # (N, K/G)
        lo, hi = w.amin(-1), w.amax(-1)
        # both ends shrunk, or only one (an outlier is usually on one side)
        ranges = [(lo * a, hi * b) for c in CLIP_SHRINKS for a, b in ((c, c), (c, 1), (1, c))]
        for lo2, hi2 in ranges:
            q2, s2, z2 = _round_groups(w, lo2, hi2, compute_dtype)
            err = ((_dequant_groups(q2, s2, z2) - w) ** 2).sum(-1)
            better = err < best
            best = torch.where(better, err, best)
            q = torch.where(better[..., None], q2, q)
            scale, zero = torch.where(better, s2, scale), torch.where(better, z2, zero)
    return q.view(n, k).to(torch.uint8), scale, zero


def _round_groups(
    w: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, compute_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w (N, K/G, G) on the range [lo, hi] (N, K/G) -> codes (N, K/G, G) in 0..15, scale and
    zero (N, K/G) in compute_dtype; codes are rounded against the stored (rounded) values."""
    scale = ((hi - lo) / 15).clamp(min=1e-12).to(compute_dtype)
    zero = (lo + 8 * scale.float()).to(compute_dtype)
    s, z = scale.float()[..., None], zero.float()[..., None]
    return torch.round((w - z) / s + 8).clamp(0, 15), scale, zero


def _dequant_groups(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return (q - 8) * scale.float()[..., None] + zero.float()[..., None]  # (N, K/G, G)
