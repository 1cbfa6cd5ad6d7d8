"""The K-quants' super-blocks read as the GGUF lays them out (ggml's block_q4_K, block_q5_K and
block_q6_K: 256 inputs each): their codes and block scales, as int32 tensors. The integer-dot
path's packers (engine_worker/int_dot.py) rearrange these for the kernel; its dequantizers and
torch's packed layers read them too. No kernel, no packing here.

    Q4_K (144 bytes): fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 of nibbles
    Q5_K (176 bytes): the same, with 32 bytes of fifth bits before the nibbles
    Q6_K (210 bytes): 128 bytes of low nibbles, 64 of top-two-bit pairs, 16 int8 scales, fp16 d
"""

from __future__ import annotations

import torch


def k4_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K super-blocks (N, S, 144) -> 6-bit scales and mins, int32 (N, S, 8) each."""
    s = b[..., 4:16].to(torch.int32)
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], -1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], -1)
    return sc, mn


def k4_codes(b: torch.Tensor) -> torch.Tensor:
    """Q4_K (N, S, 144) or Q5_K (N, S, 176) super-blocks -> codes, int32 (N, S*8, 32) by block
    of 32: the last 128 bytes, 32 per 64 inputs, low nibbles the first 32, high nibbles the
    next; Q5_K's fifth bits from the 32 bytes before them (bit i of byte j: block i, input j)."""
    qs = b[..., -128:].to(torch.int32).reshape(*b.shape[:2], 4, 1, 32)
    q = torch.cat([qs & 0x0F, qs >> 4], -2).reshape(b.shape[0], -1, 8, 32)  # (N, S, 8, 32)
    if b.shape[-1] == 176:
        qh = b[..., 16:48].to(torch.int32)[..., None, :]  # (N, S, 1, 32)
        q = q | (((qh >> torch.arange(8, dtype=torch.int32)[:, None]) & 1) << 4)
    return q.reshape(b.shape[0], -1, 32)


def k6_codes(b: torch.Tensor) -> torch.Tensor:
    """Q6_K super-blocks (N, S, 210) -> codes 0..63, int32 (N, S*8, 32) by block of 32: inputs
    h*128 + s*32 + j take nibble s//2 of ql[h*64 + (s%2)*32 + j] and bits 2s of qh[h*32 + j]."""
    ql = b[..., 0:128].to(torch.int32).reshape(*b.shape[:2], 2, 1, 64)
    qh = b[..., 128:192].to(torch.int32).reshape(*b.shape[:2], 2, 1, 32)
    low = torch.cat([ql & 0x0F, ql >> 4], -2).reshape(*b.shape[:2], 2, 4, 32)
    high = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], -2)  # (N, S, 2, 4, 32)
    return (low | (high << 4)).reshape(b.shape[0], -1, 32)
