"""Reference K-quant quantizers in numpy (the `gguf` package only dequantizes K-quants), for
writing tiny test models as Q4_K, Q5_K and Q6_K GGUF files. Plain min/max rounding, not
llama.cpp's searched scales: the blocks are valid in every bit and gguf's own dequantizer reads
them back (tests/engine_worker/model/test_gguf_kquants.py checks it).

    w float32 (N, K), K a multiple of 256 -> quantize(w, qtype) -> bytes uint8 (N, K/256 * size)
"""

from __future__ import annotations

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
QK_K = 256


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins (S, 8) -> Q4_K/Q5_K's 12 bytes (S, 12)."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    out = np.zeros((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return out


def _k_affine(w: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Super-blocks (S, 256) -> fp16 d, dmin (S,), 6-bit sc, mn (S, 8), codes (S, 8, 32)."""
    sub = w.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(-1), 0.0)
    span = (sub.max(-1) - lo) / levels
    d = _f16(span.max(-1) / 63)
    dmin = _f16((-lo).max(-1) / 63)
    df, mf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.rint(span / df), 0).clip(0, 63)
        mn = np.where(mf > 0, np.rint(-lo / mf), 0).clip(0, 63)
        step = (df * sc)[..., None]
        q = np.where(step > 0, np.rint((sub + (mf * mn)[..., None]) / step), 0)
    return d, dmin, sc, mn, q.clip(0, levels).astype(np.uint8)


def _q4_k(w: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _k_affine(w, 15)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # chunk c: sub 2c low, 2c+1 high
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2),
                           _pack_scales(sc, mn), qs], axis=1)


def _q5_k(w: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _k_affine(w, 31)
    low = q & 15
    qs = (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(-1, 128)
    hi = (q >> 4).astype(np.uint8)  # (S, 8, 32): bit i of qh[j] is sub-block i's element j
    qh = np.zeros((q.shape[0], 32), np.uint8)
    for i in range(8):
        qh |= hi[:, i, :] << i
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2),
                           _pack_scales(sc, mn), qh, qs], axis=1)


def _q6_k(w: np.ndarray) -> np.ndarray:
    sub = w.reshape(-1, 16, 16)
    s = np.abs(sub).max(-1) / 31  # (S, 16)
    d = _f16(s.max(-1) / 127)
    df = d.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.rint(s / df), 0).clip(-128, 127)
        step = (df * sc)[..., None]
        q = np.where(step > 0, np.rint(sub / step), 0).clip(-32, 31)
    q = (q + 32).astype(np.uint8).reshape(-1, 2, 128)  # halves of 128 inputs
    ql = (q[:, :, :64] & 15) | ((q[:, :, 64:] & 15) << 4)  # (S, 2, 64)
    hi = (q >> 4).reshape(-1, 2, 4, 32)  # input h*128 + s*32 + j -> bits 2s of qh[h*32 + j]
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64),
                           sc.astype(np.int8).view(np.uint8), d.view(np.uint8).reshape(-1, 2)],
                          axis=1)


_QUANTIZERS = {Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k}


def quantize(w: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """Float (N, K) -> GGUF bytes (N, row bytes) of `qtype` (K-quants here, the rest by gguf)."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    if qtype not in _QUANTIZERS:
        return gguf.quants.quantize(w, qtype)
    n, k = w.shape
    if k % QK_K:
        raise ValueError(f"{qtype.name}: K = {k} is not a multiple of {QK_K}")
    return _QUANTIZERS[qtype](w.reshape(-1, QK_K)).reshape(n, -1)
