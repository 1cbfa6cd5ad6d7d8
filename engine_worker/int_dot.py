"""Integer-dot matmuls over GGUF block weights (issues 21, 22): the C++ kernel (csrc/int_dot.cpp)
with its load-time repacking, and the pure-torch references it is tested by. Formats: the GGUF's
own Q4_0 / Q4_1 / Q8_0 / Q5_0, its Q4_K and Q6_K super-blocks as stored (q4_k, q6_k), and the
forms the other GGML types are rewritten to, code for code (engine_worker/model/ggml_types.py):
q8_1 (w = d*q + m), q6_16 (6-bit codes, one fp16 scale per 16 inputs) and q8_16 (the same with
8-bit codes).

Data flow:

    block bytes, uint8 (N, K/32 * block bytes)
      -> pack(fmt, ...) (once, at load): 8 output rows interleaved per block of 32 inputs,
         scales kept fp16, N padded to a multiple of 8 -> Packed
      -> mm(packed, x): x (M, K) float32 is quantized once per call to Q8 blocks (int8
         codes, float32 scale amax/127, code sums for Q4_1's offset) and meets every output row
         in integer dot products (AVX512-VNNI / AVX-VNNI / AVX2 / scalar, fixed when the kernel is
         built for this host: kernel_build.load_kernel) -> y (M, N) float32

References: `reference_mm` quantizes x the same way (bit-exact with the kernel's quantizer) and
computes in float64 from the GGUF bytes: the kernel must equal it within float32 accumulation.
`dequantize` gives the float64 weights for the float truth x @ W^T, which the kernel meets within
the activations' 8-bit rounding.

`load()` raises KernelUnavailable where no kernel can be built; callers keep torch's paths then.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from engine_worker.kernel_build import KernelUnavailable, load_kernel
from engine_worker.kquant_codes import k4_codes, k4_scales, k6_codes

BLOCK = 32  # inputs per quantization block
TILE = 8  # output rows interleaved per packed block
SUPER = 256  # inputs per K-quant super-block
LAYOUT = 1  # the packers' output layout; bump when any packer's changes (block caches key by it)

__all__ = ["FORMATS", "KernelUnavailable", "Packed", "dequantize", "isa", "load", "mm", "pack",
           "pack_fused", "pack_q4_0", "pack_q4_1", "pack_q4_k", "pack_q5_0", "pack_q5_k",
           "pack_q6_k",
           "pack_q6_16", "pack_q8_0", "pack_q8_1", "pack_q8_16", "quantize_q8", "reference_mm",
           "row_bytes", "FORMAT_TABLE", "WeightFormat", "register"]


class Packed(NamedTuple):
    """One weight matrix in the kernel's layout (csrc/int_dot_formats.h). T = ceil(N/8), B = K/32.
    qs: uint8 (T, B, 128) for Q4_x, int8 (T, B, 256) for q8_x; d, m: float16 (T, B, 8) (d
    (T, B, 16) for q8_16), the blocks' own scales (converted exactly; fp16 streams fewer bytes).
    q4_k / q6_k: d per super-block (T, B/8, 16 / 8), m the blocks' integer scales (T, B, 12 / 16)
    (pack_q4_k, pack_q6_k)."""

    fmt: str
    n: int
    k: int
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None


def row_bytes(fmt: str, k: int) -> int:
    """Bytes of one row of K inputs in `fmt`."""
    f = FORMAT_TABLE[fmt]
    return k // f.unit * f.unit_bytes


def _blocks(raw: np.ndarray | torch.Tensor, fmt: str, n: int, k: int) -> torch.Tensor:
    """The GGUF bytes as uint8 (N, K/32, block bytes) (the K-quants: (N, K/256, super-block
    bytes)), checked."""
    unit = FORMAT_TABLE[fmt].unit
    if k <= 0 or k % unit or n <= 0:
        raise ValueError(f"{fmt}: need N >= 1 and K a positive multiple of {unit}, got N={n}, "
                         f"K={k}")
    if isinstance(raw, torch.Tensor):
        t = raw
    else:
        with warnings.catch_warnings():  # a read-only GGUF memmap: only ever read here
            warnings.simplefilter("ignore", UserWarning)
            t = torch.as_tensor(np.asarray(raw))
    if t.dtype != torch.uint8:
        raise ValueError(f"{fmt}: raw blocks must be uint8, got {t.dtype}")
    want = (n, row_bytes(fmt, k))
    if tuple(t.shape) != want:
        raise ValueError(f"{fmt}: raw blocks must have shape {want} for N={n}, K={k}, "
                         f"got {tuple(t.shape)}")
    return t.contiguous().view(n, k // unit, FORMAT_TABLE[fmt].unit_bytes)


def _half(b: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte offset `at` of each block: float16 (N, B)."""
    return b[..., at:at + 2].contiguous().view(torch.float16)[..., 0]


def _tiles(t: torch.Tensor, n: int) -> torch.Tensor:
    """Pad dim 0 (rows) to a multiple of TILE with zeros and split it: (T, 8, ...)."""
    pad = -n % TILE
    if pad:
        t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
    return t.view(-1, TILE, *t.shape[1:])


def _scales(s: torch.Tensor, n: int) -> torch.Tensor:
    return _tiles(s, n).transpose(1, 2).contiguous()  # (T, 8, B) -> (T, B, 8)


def _interleave(codes: torch.Tensor, n: int) -> torch.Tensor:
    """Codes (N, B, V*4) -> (T, B, V*32): vector j holds bytes 4j..4j+3 of each of 8 rows."""
    t = _tiles(codes, n)  # (T, 8, B, V*4)
    nt, _, b, width = t.shape
    t = t.view(nt, TILE, b, width // 4, 4).permute(0, 2, 3, 1, 4)  # (T, B, V, 8, 4)
    return t.contiguous().view(nt, b, width * TILE)


def pack_q4_0(raw: np.ndarray | torch.Tensor, n: int, k: int) -> Packed:
    b = _blocks(raw, "q4_0", n, k)
    return Packed("q4_0", n, k, _interleave(b[..., 2:], n), _scales(_half(b, 0), n))


def pack_q4_1(raw: np.ndarray | torch.Tensor, n: int, k: int) -> Packed:
    b = _blocks(raw, "q4_1", n, k)
    return Packed("q4_1", n, k, _interleave(b[..., 4:], n), _scales(_half(b, 0), n),
                  _scales(_half(b, 2), n))


def pack_q8_0(raw: np.ndarray | torch.Tensor, n: int, k: int) -> Packed:
    b = _blocks(raw, "q8_0", n, k)
    codes = b[..., 2:].contiguous().view(torch.int8)
    return Packed("q8_0", n, k, _interleave(codes, n), _scales(_half(b, 0), n))


def pack_q5_0(raw: np.ndarray | torch.Tensor, n: int, k: int) -> Packed:
    """GGUF Q5_0 (fp16 d, 32-bit qh, 16 bytes of nibbles): the nibbles as Q4_0's, then each
    row's qh word, 8 rows a tile: qs (T, B, 160)."""
    b = _blocks(raw, "q5_0", n, k)
    nib = _interleave(b[..., 6:], n)  # (T, B, 128)
    qh = _tiles(b[..., 2:6].contiguous(), n).transpose(1, 2).reshape(nib.shape[0], -1, 32)
    return Packed("q5_0", n, k, torch.cat([nib, qh], -1).contiguous(), _scales(_half(b, 0), n))


def pack_q8_1(raw: np.ndarray | torch.Tensor, n: int, k: int) -> Packed:
    b = _blocks(raw, "q8_1", n, k)
    codes = b[..., 4:].contiguous().view(torch.int8)
    return Packed("q8_1", n, k, _interleave(codes, n), _scales(_half(b, 0), n),
                  _scales(_half(b, 2), n))


def pack_q8_16(raw: np.ndarray | torch.Tensor, n: int, k: int) -> Packed:
    b = _blocks(raw, "q8_16", n, k)
    codes = b[..., 4:].contiguous().view(torch.int8)
    d = torch.cat([_scales(_half(b, 0), n), _scales(_half(b, 2), n)], -1)  # (T, B, 16)
    return Packed("q8_16", n, k, _interleave(codes, n), d.contiguous())


def pack_q6_16(raw: np.ndarray | torch.Tensor, n: int, k: int) -> Packed:
    """q6_16 blocks: the nibbles as Q4_0's, then the top-two-bit planes, 8 rows a tile: qs
    (T, B, 192); d as q8_16's."""
    b = _blocks(raw, "q6_16", n, k)
    qs = torch.cat([_interleave(b[..., 4:20], n), _interleave(b[..., 20:28], n)], -1)
    d = torch.cat([_scales(_half(b, 0), n), _scales(_half(b, 2), n)], -1)  # (T, B, 16)
    return Packed("q6_16", n, k, qs.contiguous(), d.contiguous())


def _nibble_bytes(q: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 (..., 32) -> 16 bytes in Q4_x order (byte j: element j low, 16 + j high)."""
    return (q[..., :16] | (q[..., 16:] << 4)).to(torch.uint8)


def _per_super(x: torch.Tensor, n: int) -> torch.Tensor:
    """A value per row and super-block (N, S) -> fp16 (T, S, 8) by tile."""
    return _scales(x.to(torch.float16), n)


def _k4_scales_packed(b: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K super-blocks -> the kernel's d (T, S, 16) and m (T, B, 12) (pack_q4_k)."""
    sc, mn = k4_scales(b)  # (N, S, 8)
    d = torch.cat([_per_super(_half(b, 0), n), _per_super(_half(b, 2), n)], -1)
    sc, mn = sc.reshape(n, -1), mn.reshape(n, -1)  # (N, B)
    low = _scales(((sc & 0x0F) | ((mn & 0x0F) << 4)).to(torch.uint8), n)  # (T, B, 8)
    top = _scales((sc >> 4) | ((mn >> 4) << 2), n)  # (T, B, 8) int32, 4 bits each
    word = (top << (4 * torch.arange(TILE, dtype=torch.int32))).sum(-1, dtype=torch.int32)
    word_bytes = word.contiguous().view(torch.uint8).view(*word.shape, 4)  # little-endian
    return d.contiguous(), torch.cat([low, word_bytes], -1).contiguous()


def pack_q4_k(raw: np.ndarray | torch.Tensor, n: int, k: int) -> Packed:
    """GGUF Q4_K in the tile layout, in the file's 4.5 bits a weight: qs as Q4_1's (T, B, 128);
    d fp16 (T, S, 16): lanes 0..7 the rows' d, 8..15 their dmin; m uint8 (T, B, 12): byte i
    row i's 6-bit scale's low 4 bits and its min's (high nibble), then a 32-bit word whose bits
    4i..4i+3 hold row i's top two bits of each (scale, then min)."""
    b = _blocks(raw, "q4_k", n, k)
    d, m = _k4_scales_packed(b, n)
    return Packed("q4_k", n, k, _interleave(_nibble_bytes(k4_codes(b)), n), d, m)


def pack_q5_k(raw: np.ndarray | torch.Tensor, n: int, k: int) -> Packed:
    """GGUF Q5_K in the tile layout, in the file's 5.5 bits a weight: qs as Q5_0's (T, B, 160:
    the nibbles, then each row's fifth bits as a 32-bit word, bit e input e); d and m as
    pack_q4_k's."""
    b = _blocks(raw, "q5_k", n, k)
    q = k4_codes(b)  # (N, B, 32), 0..31
    bits = ((q.to(torch.int64) >> 4) << torch.arange(32, dtype=torch.int64)).sum(-1)
    words = bits.contiguous().view(torch.uint8).view(n, -1, 8)[..., :4]  # (N, B, 4), LE
    nib = _interleave(_nibble_bytes(q & 0x0F), n)  # (T, B, 128)
    qh = _tiles(words, n).transpose(1, 2).reshape(nib.shape[0], -1, 32)
    d, m = _k4_scales_packed(b, n)
    return Packed("q5_k", n, k, torch.cat([nib, qh], -1).contiguous(), d, m)


def pack_q6_k(raw: np.ndarray | torch.Tensor, n: int, k: int) -> Packed:
    """GGUF Q6_K in the tile layout, in the file's 6.5625 bits a weight: qs as q6_16's
    (T, B, 192); d fp16 (T, S, 8), the rows' super-block scales; m int8 (T, B, 16): lanes 0..7
    the rows' scales of inputs 0..15 of the block, 8..15 of inputs 16..31."""
    b = _blocks(raw, "q6_k", n, k)
    q = k6_codes(b)  # (N, B, 32)
    top = (q >> 4).reshape(n, -1, 2, 4, 4)  # (half, j, c)
    planes = (top << (2 * torch.arange(4, dtype=torch.int32))[:, None]).sum(-2)
    qs = torch.cat([_interleave(_nibble_bytes(q & 0x0F), n),
                    _interleave(planes.reshape(n, -1, 8).to(torch.uint8), n)], -1)
    sc = b[..., 192:208].contiguous().view(torch.int8).reshape(n, -1, 2)  # (N, B, 2)
    m = torch.cat([_scales(sc[..., 0], n), _scales(sc[..., 1], n)], -1)  # (T, B, 16)
    return Packed("q6_k", n, k, qs.contiguous(), _per_super(_half(b, 208), n), m.contiguous())


def _nibble_codes(nib: torch.Tensor) -> torch.Tensor:
    """16 bytes of Q4_x nibbles (..., 16) -> codes (..., 32): elements 0..15, then 16..31."""
    return torch.cat([nib & 0x0F, nib >> 4], -1).to(torch.int32)


def _per_half(b: torch.Tensor) -> torch.Tensor:
    """Two fp16 scales at bytes 0 and 2 of each block -> float64 (N, B, 32), one per 16."""
    return torch.cat([_half(b, 0).double()[..., None].expand(-1, -1, 16),
                      _half(b, 2).double()[..., None].expand(-1, -1, 16)], -1)


# Each dequantizer: blocks (N, K/unit, unit bytes) and whether to add the offset formats' m ->
# the weights as float64 (N, K/unit, unit).
def _dq_q4_0(b: torch.Tensor, offset: bool) -> torch.Tensor:
    return _half(b, 0).double()[..., None] * (_nibble_codes(b[..., 2:]) - 8)


def _dq_q4_1(b: torch.Tensor, offset: bool) -> torch.Tensor:
    w = _half(b, 0).double()[..., None] * _nibble_codes(b[..., 4:])
    return w + _half(b, 2).double()[..., None] if offset else w


def _dq_q8_0(b: torch.Tensor, offset: bool) -> torch.Tensor:
    return _half(b, 0).double()[..., None] * b[..., 2:].contiguous().view(torch.int8)


def _dq_q5_0(b: torch.Tensor, offset: bool) -> torch.Tensor:
    qh = b[..., 2:6].contiguous().view(torch.int32)  # (N, B, 1): bit e is element e's
    bits = (qh >> torch.arange(32, dtype=torch.int32, device=b.device)) & 1
    return _half(b, 0).double()[..., None] * ((_nibble_codes(b[..., 6:]) | (bits << 4)) - 16)


def _dq_q8_1(b: torch.Tensor, offset: bool) -> torch.Tensor:
    w = _half(b, 0).double()[..., None] * b[..., 4:].contiguous().view(torch.int8)
    return w + _half(b, 2).double()[..., None] if offset else w


def _dq_q8_16(b: torch.Tensor, offset: bool) -> torch.Tensor:
    return _per_half(b) * b[..., 4:].contiguous().view(torch.int8)


def _dq_q6_16(b: torch.Tensor, offset: bool) -> torch.Tensor:
    return _per_half(b) * (q6_codes(b) - 32)


def _dq_q4_k(b: torch.Tensor, offset: bool) -> torch.Tensor:
    sc, mn = k4_scales(b)  # (N, S, 8)
    w = (_half(b, 0).double()[..., None] * sc).reshape(b.shape[0], -1, 1) * k4_codes(b)
    if offset:
        w = w - (_half(b, 2).double()[..., None] * mn).reshape(b.shape[0], -1, 1)
    return w.reshape(*b.shape[:2], SUPER)


def _dq_q5_k(b: torch.Tensor, offset: bool) -> torch.Tensor:
    return _dq_q4_k(b, offset)  # the same scales; k4_codes reads the fifth bits


def _dq_q6_k(b: torch.Tensor, offset: bool) -> torch.Tensor:
    sc = b[..., 192:208].contiguous().view(torch.int8)  # (N, S, 16): one per 16 inputs
    scale = (_half(b, 208).double()[..., None] * sc).reshape(b.shape[0], -1, 1)
    q = (k6_codes(b) - 32).reshape(b.shape[0], -1, 16)
    return (scale * q).reshape(*b.shape[:2], SUPER)


# Each int4 row's codes for torch's packed INT4 layers: blocks -> codes 0..15 (N, K), scale and
# zero float32 (N, K/32) with w = (q - 8) * scale + zero; q8_0's: codes (N, K), scale, None.
Codes = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def _codes_q4_0(b: torch.Tensor) -> Codes:
    d = _half(b, 0).float()
    return _nibble_codes(b[..., 2:]).reshape(b.shape[0], -1), d, torch.zeros_like(d)


def _codes_q4_1(b: torch.Tensor) -> Codes:
    d = _half(b, 0).float()
    return _nibble_codes(b[..., 4:]).reshape(b.shape[0], -1), d, _half(b, 2).float() + 8 * d


def _codes_q4_k(b: torch.Tensor) -> Codes:
    sc, mn = k4_scales(b)
    s = (_half(b, 0).float()[..., None] * sc).reshape(b.shape[0], -1)
    m = (_half(b, 2).float()[..., None] * mn).reshape(b.shape[0], -1)
    return k4_codes(b).reshape(b.shape[0], -1), s, 8 * s - m


def _codes_q8_0(b: torch.Tensor) -> Codes:
    return b[..., 2:].contiguous().view(torch.int8).reshape(b.shape[0], -1), \
        _half(b, 0).float(), None


@dataclass(frozen=True)
class WeightFormat:
    """One weight format of the integer-dot path: all the Python side knows of it. A new format
    is one kernel (an op kestrel::int_dot_<name>: x, qs, d[, m], n -> y) and one row here."""

    name: str
    unit: int  # inputs per block of its bytes (32; a K-quant's super-block, 256)
    unit_bytes: int  # bytes per unit
    pack: Callable[[np.ndarray | torch.Tensor, int, int], Packed]
    dequantize: Callable[[torch.Tensor, bool], torch.Tensor]
    third: bool = False  # the op takes a third tensor, m
    ggml: str = ""  # the GGML type whose bytes these are as stored ("": a rewritten form)
    codes: Callable[[torch.Tensor], Codes] | None = None  # for torch's packed layers
    torch_kind: str = ""  # the packed layer torch serves it by (matmul_plan's kinds), if any
    packs_as: str = ""  # a format torch's layers take it as, rewritten (Blocks.packable)


FORMAT_TABLE: dict[str, WeightFormat] = {f.name: f for f in (
    # the GGUF's own blocks of 32: fp16 d (and m), then the codes
    WeightFormat("q4_0", BLOCK, 18, pack_q4_0, _dq_q4_0, ggml="Q4_0", codes=_codes_q4_0,
                 torch_kind="int4"),
    WeightFormat("q4_1", BLOCK, 20, pack_q4_1, _dq_q4_1, third=True, ggml="Q4_1",
                 codes=_codes_q4_1, torch_kind="int4"),
    WeightFormat("q8_0", BLOCK, 34, pack_q8_0, _dq_q8_0, ggml="Q8_0", codes=_codes_q8_0,
                 torch_kind="int8_groups"),
    WeightFormat("q5_0", BLOCK, 22, pack_q5_0, _dq_q5_0, ggml="Q5_0",
                 torch_kind="int8_groups", packs_as="q8_0"),
    # the K-quants as stored, super-blocks of 256 (see pack_q4_k, pack_q6_k)
    WeightFormat("q4_k", SUPER, 144, pack_q4_k, _dq_q4_k, third=True, ggml="Q4_K",
                 codes=_codes_q4_k, torch_kind="int4"),
    WeightFormat("q5_k", SUPER, 176, pack_q5_k, _dq_q5_k, third=True, ggml="Q5_K"),
    WeightFormat("q6_k", SUPER, 210, pack_q6_k, _dq_q6_k, third=True, ggml="Q6_K"),
    # forms other types are rewritten to (model/ggml_types.py): fp16 d, fp16 m or a second d,
    # then the codes: 32 bytes; q6_16: 16 bytes of low nibbles in Q4_x order, 8 bytes of the
    # codes' top two bits (byte c, bits 2j..2j+1: element 4j+c's; byte 4+c: element 16+4j+c's)
    WeightFormat("q8_1", BLOCK, 36, pack_q8_1, _dq_q8_1, third=True),
    WeightFormat("q8_16", BLOCK, 36, pack_q8_16, _dq_q8_16),
    WeightFormat("q6_16", BLOCK, 28, pack_q6_16, _dq_q6_16),
)}
FORMATS = tuple(FORMAT_TABLE)  # the built-in formats
BLOCK_BYTES = {f.name: f.unit_bytes for f in FORMAT_TABLE.values() if f.unit == BLOCK}
SUPER_BYTES = {f.name: f.unit_bytes for f in FORMAT_TABLE.values() if f.unit == SUPER}


def register(f: WeightFormat) -> None:
    """Add a format (its kernel registered as kestrel::int_dot_<name>, with its fake)."""
    if f.name in FORMAT_TABLE:
        raise ValueError(f"weight format {f.name!r} is already registered")
    FORMAT_TABLE[f.name] = f


def unregister(name: str) -> None:
    """Remove a format `register` added (the built-in ones stay)."""
    if name in FORMATS:
        raise ValueError(f"{name!r} is a built-in weight format")
    FORMAT_TABLE.pop(name, None)


def stored_as(ggml: str) -> WeightFormat | None:
    """The format serving a GGML type's bytes as they are stored, if one does."""
    return next((f for f in FORMAT_TABLE.values() if f.ggml == ggml), None)


def q6_codes(b: torch.Tensor) -> torch.Tensor:
    """q6_16 blocks (N, B, 28) -> their codes 0..63, int32 (N, B, 32)."""
    nib = b[..., 4:20].to(torch.int32)
    low = torch.cat([nib & 0x0F, nib >> 4], -1)  # elements 0..15, then 16..31
    e = torch.arange(32, device=b.device)
    byte = 20 + e % 4 + 4 * (e // 16)  # element e's top bits: byte, then bits 2 * shift
    shift = 2 * ((e % 16) // 4)
    return low | (((b[..., byte].to(torch.int32) >> shift) & 3) << 4)


def pack(fmt: str, raw: np.ndarray | torch.Tensor, n: int, k: int) -> Packed:
    if fmt not in FORMAT_TABLE:
        raise ValueError(f"unknown format {fmt!r}: expected one of {', '.join(FORMAT_TABLE)}")
    return FORMAT_TABLE[fmt].pack(raw, n, k)


def pack_fused(fmt: str, raws: list[np.ndarray | torch.Tensor], k: int) -> Packed:
    """Several matrices over the same input (q|k|v, gate|up), their rows one after another:
    one call then quantizes x once for all of them. Split y by the matrices' row counts."""
    parts = [r if isinstance(r, torch.Tensor) else torch.from_numpy(np.array(r)) for r in raws]
    return pack(fmt, torch.cat(parts), sum(p.shape[0] for p in parts), k)


@cache
def _register_fake() -> None:
    """Shape-only versions for torch.compile: once per process, whichever cache dir built it."""

    def fake(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, n: int) -> torch.Tensor:
        return x.new_empty(x.shape[0], n)

    def fake_offset(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                    n: int) -> torch.Tensor:
        return x.new_empty(x.shape[0], n)

    for fmt in FORMATS:
        torch.library.register_fake(f"kestrel::int_dot_{fmt}")(
            fake_offset if FORMAT_TABLE[fmt].third else fake)


def load(cache_dir: str | Path | None = None) -> None:
    """Build (first time on this host) and load the kernel; KernelUnavailable says why not.
    cache_dir: where built kernels live (default: KESTREL_CACHE_DIR or the worker's default)."""
    if cache_dir is None:
        from engine_worker.config import cache_dir_from_env

        cache_dir = cache_dir_from_env()
    load_kernel("int_dot", str(cache_dir), "int_dot_q4_0", seconds=30)
    _register_fake()


def isa() -> str:
    """The instruction path the loaded kernel was compiled with: avx512vnni, avxvnni, avx2 or
    scalar (load() first)."""
    return torch.ops.kestrel.int_dot_isa()


def mm(p: Packed, x: torch.Tensor) -> torch.Tensor:
    """y (M, N) float32 = x (M, K) float32 @ W^T through the kernel (load() first)."""
    if FORMAT_TABLE[p.fmt].third:
        return getattr(torch.ops.kestrel, f"int_dot_{p.fmt}")(x, p.qs, p.d, p.m, p.n)
    return getattr(torch.ops.kestrel, f"int_dot_{p.fmt}")(x, p.qs, p.d, p.n)


# --- references (pure torch) -------------------------------------------------------------------

def quantize_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (M, K) float32 -> (codes int8 (M, K), scales float32 (M, K/32), code sums int32), the
    kernel's quantizer bit for bit: d = amax/127, codes round(x * (127/amax)) ties to even, all
    in float32 (tensor by tensor division: torch's scalar forms multiply by a reciprocal)."""
    m, k = x.shape
    xb = x.float().reshape(m, k // BLOCK, BLOCK)
    finite = torch.isfinite(xb).all(-1)  # a block with NaN or inf: codes 0, scale NaN
    amax = torch.where(finite[..., None], xb, 0).abs().amax(-1)
    live, c127, zero = amax >= 1e-30, torch.full_like(amax, 127.0), torch.zeros_like(amax)
    d = torch.where(live, amax / c127, zero)  # a block below 1e-30 quantizes to zeros
    d = torch.where(finite, d, torch.full_like(d, float("nan")))
    inv = torch.where(live, c127 / torch.where(live, amax, c127), zero)
    codes = torch.round(torch.where(finite[..., None], xb, 0) * inv[..., None])
    return (codes.to(torch.int8).reshape(m, k), d, codes.sum(-1).to(torch.int32))


def dequantize(fmt: str, raw: np.ndarray | torch.Tensor, n: int, k: int,
               offset: bool = True) -> torch.Tensor:
    """The weights as float64 (N, K). offset=False leaves out the offset formats' m (the part of
    w that the kernel takes through the activations' code sums)."""
    b = _blocks(raw, fmt, n, k)
    return FORMAT_TABLE[fmt].dequantize(b, offset).double().reshape(n, k)


def reference_mm(fmt: str, x: torch.Tensor, raw: np.ndarray | torch.Tensor, n: int,
                 k: int) -> torch.Tensor:
    """What the kernel computes, in float64: x quantized to Q8 as the kernel does, times the
    GGUF weights. Returns float64 (M, N)."""
    codes, d, _ = quantize_q8(x)
    xq = (codes.double().view(x.shape[0], -1, BLOCK) * d.double()[..., None]).view(x.shape)
    return xq @ dequantize(fmt, raw, n, k).t()
