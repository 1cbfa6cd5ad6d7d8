"""A GGUF tensor's blocks in one of the integer-dot kernel's formats, codes untouched.

    GGUFReader tensor (numpy memmap of the file's bytes)
      -> read_tensor: by GGML type
           Q4_0, Q4_1, Q8_0, Q5_0    as they are (the kernel reads them natively)
           Q4_K, Q5_K, Q6_K           as they are, super-blocks of 256 (q4_k, q5_k, q6_k: the
                                       kernel reads their two-level scales; 4.5, 5.5 and 6.5625
                                       bits a weight)
           Q5_1  (d, m, 5-bit q)      -> q8_1:  codes q, the same d and m            (exact)
           F32 / F16 / BF16           -> float32 (norms, biases)
           anything else               -> gguf's own dequantize (float32), named in the log
      -> Blocks: fmt, raw bytes (N, K/32 * block bytes); codes / scales / float view on demand
         (for torch's packed kernels, where ours is not built, Q5_0 is rewritten as Q8_0 with
         codes q - 16 and the same d: exact)

Every code is the file's own. The K-quants keep their two-level scales (an fp16 super-block
scale times a 6- or 8-bit block scale): the kernel multiplies them out exactly. Nothing is
re-quantized and no float copy of a quantized tensor is made. (`convert(as_stored=False)` still
gives the per-block forms the K-quants were once rewritten to, q4_1, q8_1 and q6_16, with the
products rounded to fp16, for comparisons.)
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine_worker import int_dot
from engine_worker.model.gguf_header import tensor_table

log = logging.getLogger("kestrel.gguf")

QK_K = 256  # inputs per K-quant super-block


def _f16(b: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte `at` of each block (..., bytes) as float32 (..., )."""
    return b[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _h(x: np.ndarray) -> np.ndarray:
    """float32 (...) -> its fp16 bytes (..., 2)."""
    return x.astype(np.float16)[..., None].view(np.uint8)


def _bits(qh: np.ndarray, count: int) -> np.ndarray:
    """Little-endian bit planes: (..., bytes) -> (..., bytes * 8) of 0/1, bit i of the stream."""
    return np.unpackbits(qh, axis=-1, bitorder="little")[..., :count]


def _q5(b: np.ndarray, qh_at: int) -> np.ndarray:
    """Q5_0/Q5_1 codes 0..31 (N, B, 32): low nibbles of 16 bytes are elements 0..15, high nibbles
    16..31; bit j of the 32-bit qh is element j's fifth bit."""
    qs = b[..., qh_at + 4:qh_at + 20]
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    return low | (_bits(b[..., qh_at:qh_at + 4], 32) << 4)


def _scale_min_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins, (..., 8) each."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K super-blocks (N, S, bytes) -> per-32 scale and offset (N, S*8) float32:
    w = scale * q + offset."""
    sc, mn = _scale_min_k4(b[..., 4:16])
    return _f16(b, 0)[..., None] * sc, -(_f16(b, 2)[..., None] * mn)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """Codes 0..15 (..., 32) -> 16 bytes in Q4_x order (byte j: element j low, 16 + j high)."""
    return (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)


def q6_body(q: np.ndarray) -> np.ndarray:
    """Codes 0..63 (..., 32) -> q6_16's 24 bytes after its scales (int_dot.BLOCK_BYTES): the low
    nibbles in Q4_x order, then byte c holding in bits 2j..2j+1 the top bits of element 4j+c,
    byte 4+c those of element 16+4j+c."""
    top = (q >> 4).astype(np.uint8).reshape(*q.shape[:-1], 2, 4, 4)  # (half, j, c)
    planes = (top << (2 * np.arange(4, dtype=np.uint8))[:, None]).sum(-2, dtype=np.uint8)
    return np.concatenate([_nibbles(q & 0x0F), planes.reshape(*q.shape[:-1], 8)], axis=-1)


def convert(kind: Any, data: np.ndarray, n: int, k: int,
            as_stored: bool = True) -> tuple[str, np.ndarray] | None:
    """A quantized tensor's bytes (N, row bytes) -> (kernel format, its bytes (N, K/32 * block
    bytes)); None for a type with no exact kernel form. as_stored=False: the types a format
    serves as stored but that have a rewritten form too (Q4_K and Q6_K in the per-block forms
    they were once served in, q4_1 and q6_16: 5 and 7 bits a weight) in that form, for
    comparisons."""
    import gguf

    qt = gguf.GGMLQuantizationType
    stored = int_dot.stored_as(kind.name)
    if stored is not None and as_stored:
        return stored.name, data
    if kind == qt.Q5_1:
        b = data.reshape(n, k // 32, 24)
        out = np.concatenate([b[..., 0:4], _q5(b, 4).astype(np.uint8)], axis=-1)
        return "q8_1", out.reshape(n, -1)
    if kind in (qt.Q4_K, qt.Q5_K):
        per = 144 if kind == qt.Q4_K else 176
        b = data.reshape(n, k // QK_K, per)
        scale, offset = _k_scales(b)  # (N, S*8)
        qs = b[..., per - 128:].reshape(n, -1, 4, 32)  # 4 chunks of 64 inputs
        q = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, -1, 8, 32)  # (N, S, 8, 32)
        if kind == qt.Q5_K:
            hi = _bits(b[..., 16:48].reshape(n, -1, 1, 32).transpose(0, 1, 3, 2), 8)
            q = q | (hi.transpose(0, 1, 3, 2) << 4)  # bit i of qh[j]: sub-block i, element j
        q = q.reshape(n, -1, 32)
        head = np.concatenate([_h(scale.reshape(n, -1)), _h(offset.reshape(n, -1))], axis=-1)
        if kind == qt.Q4_K:
            return "q4_1", np.concatenate([head, _nibbles(q)], axis=-1).reshape(n, -1)
        return "q8_1", np.concatenate([head, q.astype(np.uint8)], axis=-1).reshape(n, -1)
    if kind == qt.Q6_K:
        b = data.reshape(n, k // QK_K, 210)
        ql, qh = b[..., 0:128], b[..., 128:192]
        sc = b[..., 192:208].copy().view(np.int8).astype(np.float32)  # (N, S, 16)
        d = _f16(b, 208)[..., None] * sc  # per 16 inputs
        # inputs h*128 + s*64 + j: nibble s of ql[h*64 + j]; h*128 + s*32 + j: bits 2s of qh
        low = np.stack([ql.reshape(n, -1, 2, 64) & 0x0F, ql.reshape(n, -1, 2, 64) >> 4], 3)
        high = np.stack([(qh.reshape(n, -1, 2, 32) >> s) & 3 for s in (0, 2, 4, 6)], 3)
        q = low.reshape(n, -1, 2, 128) | (high.reshape(n, -1, 2, 128) << 4)
        ds = d.reshape(n, -1, 2)  # (N, B, 2): halves of each block of 32
        head = np.concatenate([_h(ds[..., 0]), _h(ds[..., 1])], axis=-1)
        return "q6_16", np.concatenate([head, q6_body(q.reshape(n, -1, 32))],
                                       axis=-1).reshape(n, -1)
    return None if stored is None else (stored.name, data)


# The GGML types `convert` rewrites into a kernel format (the others a format serves as stored:
# int_dot.FORMAT_TABLE; any other is dequantized to float).
_REWRITTEN = {"Q5_1": "q8_1", "Q5_K": "q8_1"}


def kernel_format(t: Any) -> str:
    """The format `read_tensor` gives a GGUFReader tensor, without reading its data."""
    name = t.tensor_type.name
    stored = int_dot.stored_as(name)
    return stored.name if stored is not None else _REWRITTEN.get(name, "float")


class Blocks:
    """One tensor's rows: a kernel format and its bytes (N, K/32 * block bytes), or floats."""

    def __init__(self, fmt: str, raw: np.ndarray, n: int, k: int) -> None:
        self.fmt, self.raw, self.n, self.k = fmt, raw, n, k  # fmt "float": raw is float32 (N, K)

    @property
    def kind(self) -> str:
        """What torch's packed layers can take: "int4" (q4_x), "int8" (q8_0), else "float"."""
        f = int_dot.FORMAT_TABLE.get(self.fmt)
        if f is None or f.codes is None:
            return "float"
        return "int4" if f.torch_kind == "int4" else "int8"

    def take_rows(self, order: np.ndarray) -> Blocks:
        return Blocks(self.fmt, self.raw[order], self.n, self.k)

    def packable(self) -> Blocks:
        """These blocks in a format torch's packed kernels take where one holds them exactly
        (Q5_0 as Q8_0: codes q - 16, the same d); else themselves."""
        f = int_dot.FORMAT_TABLE.get(self.fmt)
        if f is None or not f.packs_as:
            return self
        assert self.fmt == "q5_0" and f.packs_as == "q8_0"  # the one format rewritten for torch
        b = self.raw.reshape(self.n, self.k // 32, 22)
        codes = (_q5(b, 2).astype(np.int16) - 16).astype(np.int8)
        out = np.concatenate([b[..., 0:2], codes.view(np.uint8)], axis=-1)
        return Blocks("q8_0", out.reshape(self.n, -1), self.n, self.k)

    def codes_scales(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """int4: codes 0..15 (N, K), scale and zero (N, K/32), w = (q - 8) * scale + zero;
        int8: codes (N, K), scale (N, K/32), w = q * scale (the format's table row says how)."""
        f = int_dot.FORMAT_TABLE[self.fmt]
        assert f.codes is not None, f"{self.fmt} has no form torch's packed layers take"
        b = torch.from_numpy(np.ascontiguousarray(self.raw)).view(self.n, self.k // f.unit,
                                                                  f.unit_bytes)
        q, scale, zero = f.codes(b)
        return q.numpy(), scale.numpy(), None if zero is None else zero.numpy()

    def floats(self) -> np.ndarray:
        """The float32 (N, K) matrix these blocks stand for."""
        if self.fmt == "float":
            return self.raw
        w = int_dot.dequantize(self.fmt, self.raw, self.n, self.k)
        return w.numpy().astype(np.float32)


def tensors(gguf_path: Path) -> dict[str, Any]:
    """The file's tensors by name (GGUFReader's, from gguf_header.tensor_table: its tensor table
    read alone, not gguf-py's parse of every metadata array). A start reads them three times
    (the file's types, the path choice, the load): read once, kept until `forget_tensors()`
    unmaps it."""
    st = os.stat(gguf_path)
    return _tensors(str(gguf_path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=1)
def _tensors(path: str, _mtime_ns: int, _size: int) -> dict[str, Any]:
    return tensor_table(Path(path))


forget_tensors = _tensors.cache_clear


def read_tensor(t: Any) -> Blocks:
    """A GGUFReader tensor -> Blocks, without dequantizing any type the kernel can serve."""
    import gguf

    qt = gguf.GGMLQuantizationType
    shape = [int(x) for x in reversed(t.shape.tolist())]  # GGUF lists dims innermost first
    n, k = (shape[0], int(np.prod(shape[1:]))) if len(shape) > 1 else (1, shape[0])
    data = np.asarray(t.data)
    if t.tensor_type in (qt.F32, qt.F16, qt.BF16):
        return Blocks("float", data.astype(np.float32).reshape(shape), n, k)
    got = convert(t.tensor_type, data.reshape(n, -1), n, k) if k % 32 == 0 else None
    if got is not None:
        return Blocks(got[0], got[1], n, k)
    log.warning("%s: GGML type %s has no integer-dot form; dequantized to float32", t.name,
                t.tensor_type.name)
    w = gguf.dequantize(data, t.tensor_type).reshape(n, k).astype(np.float32)
    return Blocks("float", w, n, k)


def cat(parts: list[Blocks]) -> Blocks:
    """Several matrices over the same input, rows one after another (q|k|v, gate|up); mixed
    formats (the 0.5B Qwen's Q5_0 q/k with a Q8_0 v) are kept apart by the caller. The rows
    are joined when first read: a layer mapped packed from the block cache never reads them."""
    if len(parts) == 1:
        return parts[0]
    if len({p.fmt for p in parts}) != 1:
        raise ValueError("cat: parts in different formats")
    return _Joined(parts)


class _Joined(Blocks):
    """Blocks whose rows are several Blocks' one after another, joined on first read."""

    def __init__(self, parts: list[Blocks]) -> None:  # no super().__init__: raw is computed
        self.parts = parts
        self.fmt, self.n, self.k = parts[0].fmt, sum(p.n for p in parts), parts[0].k

    @functools.cached_property
    def raw(self) -> np.ndarray:  # type: ignore[override]
        return np.concatenate([p.raw for p in self.parts])
