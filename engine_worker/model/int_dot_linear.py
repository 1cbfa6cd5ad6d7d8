"""A GGUF Q4_0 / Q4_1 / Q8_0 matrix served by the integer-dot kernel at few rows.

    x (..., K) float32, rows <= max_rows ──int_dot.mm──▶ activations quantized once to Q8
        blocks, integer dot products against the file's own blocks (repacked at load)
    more rows (a prefill chunk), or another dtype ──▶ `fallback`, the layer the model had
        (torch's packed kernel, or its float copy from some rows up)

The row limit comes from measuring on the host (engine_worker/path_choice.py): the kernel runs
where it was timed faster, never because it was fast elsewhere. A row's result does not depend
on the other rows of its batch (the kernel quantizes each row on its own).
"""

from __future__ import annotations

import torch
from torch import nn

from engine_worker import int_dot


class IntDotLinear(nn.Module):
    def __init__(self, packed: int_dot.Packed, fallback: nn.Module, max_rows: int) -> None:
        super().__init__()
        self.packed = packed
        self.fallback = fallback
        self.max_rows = min(max_rows, int_dot.MAX_ROWS)
        self.in_features, self.out_features = packed.k, packed.n

    @classmethod
    def from_gguf(cls, fmt: str, raw: object, fallback: nn.Module, max_rows: int) -> IntDotLinear:
        n, k = fallback.out_features, fallback.in_features
        return cls(int_dot.pack(fmt, raw, n, k), fallback, max_rows)  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        if not 0 < rows <= self.max_rows or x.dtype != torch.float32:
            return self.fallback(x)
        y = int_dot.mm(self.packed, x.reshape(rows, x.shape[-1]).contiguous())
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"{self.packed.fmt}, in={self.in_features}, out={self.out_features}, "
                f"int_dot up to {self.max_rows} rows")
