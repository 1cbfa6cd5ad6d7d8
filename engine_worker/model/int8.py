"""INT8 weights, symmetric per output channel: a linear layer and an embedding table that may
share one quantized matrix with a tied head (engine_worker/model/quant.py swaps them in).

    x (M, K) --Int8Linear--> (M, N): torch's packed int8 matmul on CPU, activations in bfloat16
                                     (`kernel_dtype`); elsewhere dequantize, then F.linear
    ids (N,) --Int8Embedding--> (N, C): rows gathered in int8, scaled per row
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_INT8_MM = getattr(torch, "_weight_int8pack_mm", None)


def kernel_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """Dtype the CPU kernels compute in: bfloat16 (the fast one measured), whatever the model's."""
    return torch.bfloat16 if device.type == "cpu" else dtype


class Int8Linear(nn.Module):
    """Symmetric per-output-channel INT8: w[n, :] ~= qweight[n, :] * scales[n],
    scales[n] = max|w[n, :]| / 127. 1 byte a weight plus one float per row."""

    def __init__(
        self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
        use_kernel: bool,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = qweight.shape[1], qweight.shape[0]
        self.register_buffer("qweight", qweight)  # (N, K) int8
        self.register_buffer("scales", scales)  # (N,) compute dtype
        self.register_buffer("bias", bias)  # (N,) model dtype or None
        self.use_kernel = use_kernel
        # one path at every row count (model/matmul_plan.py): torch's kernel, or dequantize
        self.path = "_kernel" if use_kernel else "_dequantized"

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
        compute_dtype: torch.dtype | None = None, use_kernel: bool | None = None,
    ) -> Int8Linear:
        if use_kernel is None:
            use_kernel = _INT8_MM is not None and weight.device.type == "cpu"
        if compute_dtype is None:
            compute_dtype = kernel_dtype(weight.device, weight.dtype) if use_kernel \
                else weight.dtype
        w = weight.detach().float()  # (N, K)
        scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12).to(compute_dtype)  # (N,)
        q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(q.contiguous(), scales, None if bias is None else bias.detach().clone(),
                   use_kernel)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.qweight.to(dtype) * self.scales.to(dtype)[:, None])  # (N, K)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        return _INT8_MM(x.to(self.scales.dtype), self.qweight, self.scales).to(x.dtype)

    def _dequantized(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantize(x.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = getattr(self, self.path)(x)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, kernel={self.use_kernel}"


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
        q = Int8Linear.from_float(weight, compute_dtype=torch.float32, use_kernel=False)
        return cls(q.qweight, q.scales, weight.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(ids, self.qweight).to(self.dtype)  # (N, C)
        return rows * self.scales.index_select(0, ids).to(self.dtype)[:, None]
