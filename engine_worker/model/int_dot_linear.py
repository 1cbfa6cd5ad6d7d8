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


class IntDotLinear(nn.Module):
    def __init__(self, packed: int_dot.Packed, fallback: nn.Module | None, max_rows: int,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.packed = packed
        self.fallback = fallback
        self.max_rows = max_rows if fallback is not None else 1 << 62
        self.in_features, self.out_features = packed.k, packed.n
        self.bias: torch.Tensor | None
        self.register_buffer("bias", bias)

    @classmethod
    def from_gguf(cls, fmt: str, raw: object, fallback: nn.Module | None, max_rows: int,
                  n: int, k: int, bias: torch.Tensor | None = None) -> IntDotLinear:
        return cls(int_dot.pack(fmt, raw, n, k), fallback, max_rows, bias)  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        if self.fallback is not None and (not 0 < rows <= self.max_rows
                                          or x.dtype != torch.float32):
            y = self.fallback(x)
        elif rows == 0:
            y = x.new_zeros(*x.shape[:-1], self.out_features)
        else:
            xf = x.reshape(rows, x.shape[-1]).to(torch.float32).contiguous()
            y = int_dot.mm(self.packed, xf).reshape(*x.shape[:-1], self.out_features)
            y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        rows = f"up to {self.max_rows} rows" if self.fallback is not None else "every row count"
        return (f"{self.packed.fmt}, in={self.in_features}, out={self.out_features}, "
                f"int_dot at {rows}, bias={self.bias is not None}")
