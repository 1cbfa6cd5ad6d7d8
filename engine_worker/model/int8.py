"""INT8 weights, symmetric per output channel: a linear layer and an embedding table that may
share one quantized matrix with a tied head (engine_worker/model/quant.py swaps them in).

    x (M, K) --Int8Linear--> (M, N): by its routes, torch's packed int8 matmul (on CPU,
                                     activations in bfloat16), or dequantize, then F.linear
    ids (N,) --Int8Embedding--> (N, C): rows gathered in int8, scaled per row
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine_worker.model.matmul_plan import Route, default_routes, routes_dtype
from engine_worker.model.routed_linear import RoutedLinear

_INT8_MM = getattr(torch, "_weight_int8pack_mm", None)


def per_row(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes (N, K) int8, scales (N,) in `dtype`): scale = max|w[n, :]| / 127, codes rounded
    against the stored scale."""
    w = weight.detach().float()  # (N, K)
    scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12).to(dtype)  # (N,)
    q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scales


class Int8Linear(RoutedLinear):
    """Symmetric per-output-channel INT8: w[n, :] ~= qweight[n, :] * scales[n],
    scales[n] = max|w[n, :]| / 127. 1 byte a weight plus one number per row.

    `routes` (model/matmul_plan.py): the path each row count takes, "int8" (torch's kernel, the
    activations in the route's dtype) or "dequantize" (in the activations' dtype); the scales
    are kept in the dtype of the route that names one (else the weights')."""

    def __init__(
        self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
        routes: tuple[Route, ...],
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = qweight.shape[1], qweight.shape[0]
        self.register_buffer("qweight", qweight)  # (N, K) int8
        self.register_buffer("scales", scales)  # (N,)
        self.register_buffer("bias", bias)  # (N,) model dtype or None
        self.register_buffer("dense", None)
        self.set_routes(routes)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                   routes: tuple[Route, ...] | None = None) -> Int8Linear:
        routes = default_routes("int8", weight.device.type) if routes is None else routes
        q, scales = per_row(weight, routes_dtype(routes) or weight.dtype)
        return cls(q, scales, None if bias is None else bias.detach().clone(), routes)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.qweight.to(dtype) * self.scales.to(dtype)[:, None])  # (N, K)

    def _int8(self, x: torch.Tensor) -> torch.Tensor:
        return _INT8_MM(x.to(self.scales.dtype), self.qweight, self.scales).to(x.dtype)

    def _dequantize(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantize(x.dtype))



class Int8Embedding(nn.Module):
    """Row-wise INT8 embedding table; may share qweight/scales with a tied Int8Linear head.
    No `weight` attribute on purpose: code that reads `embed_tokens.weight` must fail loudly."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight)  # (V, C) int8
        self.register_buffer("scales", scales)  # (V,)
        self.dtype = dtype

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> Int8Embedding:
        return cls(*per_row(weight, torch.float32), weight.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(ids, self.qweight).to(self.dtype)  # (N, C)
        return rows * self.scales.index_select(0, ids).to(self.dtype)[:, None]
