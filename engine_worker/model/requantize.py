"""A GGUF tensor's blocks re-quantized to a narrower format: how a speculative draft model reads
fewer bytes a token than its file holds.

    Blocks (q5_0, q8_0, q6_k, ...) --requantized(b, "q4_0")--> Blocks (q4_0)
        the file's weights (dequantized in chunks of rows) -> Q4_0 as llama.cpp quantizes it:
        per block of 32, d = the value of largest magnitude / -8, codes min(15, x / d + 8.5)

Only a draft takes this (--speculative-draft-quantization): its tokens are guesses the served
model verifies, so its weights may be coarser without changing a word of the output; what it
costs is a few guesses the served model would have accepted (bench_speculative.py counts them).
A tensor already at or below the format's bits a weight (Q4_0, Q4_K: 4.5) is kept as it is.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from engine_worker import int_dot
from engine_worker.config import REQUANTIZE_FORMATS
from engine_worker.model.ggml_types import Blocks

FORMATS = REQUANTIZE_FORMATS  # the formats a draft may be re-quantized to
ROWS = 8192  # rows dequantized at a time (the 0.5B Qwen's head: 151,936 rows of 896)


def bits(fmt: str) -> float:
    """Bits a weight of `fmt` takes (its blocks' bytes over their weights); float: 32."""
    f = int_dot.FORMAT_TABLE.get(fmt)
    return 32.0 if f is None else 8.0 * f.unit_bytes / f.unit


def format_of(fmt: str, to: str) -> str:
    """The format a tensor stored in `fmt` is served in when re-quantizing to `to` ("none":
    not re-quantizing)."""
    if to == "none":
        return fmt
    if to not in FORMATS:
        raise ValueError(f"cannot re-quantize to {to!r}: one of {', '.join(FORMATS)}")
    return fmt if fmt == "float" or bits(fmt) <= bits(to) else to


def quantize_q4_0(w: torch.Tensor) -> np.ndarray:
    """w (N, K) float -> the GGUF's Q4_0 bytes (N, K/32 * 18): fp16 d, then 16 bytes of codes
    (byte j: element j in the low nibble, element 16 + j in the high one); w ~ (q - 8) * d."""
    n, k = w.shape
    x = w.float().reshape(n, k // int_dot.BLOCK, int_dot.BLOCK)
    at = x.abs().argmax(-1, keepdim=True)
    d = torch.gather(x, -1, at)[..., 0] / -8  # the largest magnitude lands on code 0 exactly
    inv = torch.where(d != 0, 1 / torch.where(d != 0, d, 1), 0)
    q = (x * inv[..., None] + 8.5).clamp(0, 15).to(torch.uint8)  # truncation, as ggml's
    nib = q[..., :16] | (q[..., 16:] << 4)
    half = d.to(torch.float16).view(torch.uint8).reshape(n, -1, 2)
    return torch.cat([half, nib], -1).reshape(n, -1).numpy()


def requantized(b: Blocks, fmt: str) -> Blocks:
    """`b` in `fmt` where that takes fewer bits a weight (its bytes computed when first read:
    a layer the block cache maps packed never reads them); else `b` itself."""
    if format_of(b.fmt, fmt) == b.fmt:  # (a quantized tensor's K is whole blocks of 32)
        return b
    return _Requantized(b, fmt)


class _Requantized(Blocks):
    def __init__(self, source: Blocks, fmt: str) -> None:  # no super().__init__: raw is computed
        self.source = source
        self.fmt, self.n, self.k = fmt, source.n, source.k

    @functools.cached_property
    def raw(self) -> np.ndarray:  # type: ignore[override]
        src, out = self.source, np.empty((self.n, int_dot.row_bytes(self.fmt, self.k)), np.uint8)
        for at in range(0, self.n, ROWS):
            rows = min(ROWS, self.n - at)
            out[at:at + rows] = quantize_q4_0(int_dot.dequantize(src.fmt, src.raw[at:at + rows],
                                                                 rows, self.k))
        return out
