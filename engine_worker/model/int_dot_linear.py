"""A GGUF block-quantized matrix served by the integer-dot kernel.

    x (..., K) float32, rows <= max_rows ──int_dot.mm──▶ activations quantized once to Q8
        blocks, integer dot products against the file's own blocks (repacked at load)
    more rows (a prefill chunk), or another dtype ──▶ `fallback`, the layer the model had
        (torch's packed kernel, or its float copy from some rows up)
    no fallback (the types torch has no packed kernel for: K-quants, Q5_x) ──▶ the kernel at
        every row count; float64/bfloat16 inputs are computed in float32 and cast back

The row limit comes from measuring on the host (engine_worker/path_choice.py): the kernel runs
where it was timed faster, never because it was fast elsewhere. A row's result does not depend
on the other rows of its batch (the kernel quantizes each row on its own). `bias` (Qwen2's q, k
and v) is added in float32 after the matmul, on either path.
"""

from __future__ import annotations

import torch
from torch import nn

from engine_worker import int_dot
from engine_worker.model.matmul_plan import ALL, Route
from engine_worker.model.routed_linear import RoutedLinear


class IntDotLinear(RoutedLinear):
    def __init__(self, packed: int_dot.Packed, fallback: nn.Module | None, max_rows: int,
                 bias: torch.Tensor | None = None) -> None:
        """`max_rows`: the plan's bound for the kernel (model/matmul_plan.py); more rows take
        `fallback`, the layer the plan put behind it (None: the kernel at every row count)."""
        super().__init__()
        self.packed = packed
        self.fallback = fallback
        self.max_rows = max_rows if fallback is not None else ALL
        self.in_features, self.out_features = packed.k, packed.n
        self.register_buffer("bias", bias)
        self.register_buffer("dense", None)
        self.set_routes((Route(self.max_rows, "int_dot"), Route(ALL, "fallback"))
                        if fallback is not None else (Route(ALL, "int_dot"),))

    def _int_dot(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        xf = x.reshape(rows, x.shape[-1]).to(torch.float32).contiguous()
        y = int_dot.mm(self.packed, xf).reshape(*x.shape[:-1], self.out_features)
        return y.to(x.dtype)

    def _fallback(self, x: torch.Tensor) -> torch.Tensor:
        assert self.fallback is not None
        return self.fallback(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        if rows == 0:  # an empty batch: nothing to multiply
            y = x.new_zeros(*x.shape[:-1], self.out_features)
        elif x.dtype != torch.float32 and self.fallback is not None:
            y = self.fallback(x)  # the kernel takes float32 (a float64 reference, bfloat16)
        else:
            y = getattr(self, self.path(rows))(x)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        rows = f"up to {self.max_rows} rows" if self.fallback is not None else "every row count"
        return (f"{self.packed.fmt}, in={self.in_features}, out={self.out_features}, "
                f"int_dot at {rows}, bias={self.bias is not None}")
