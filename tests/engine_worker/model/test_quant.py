"""INT8 / INT4 weight-only quantization: accuracy, storage, kernel vs fallback, model convert."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine_worker.model.int4 import Int4GroupLinear, pack_int4, unpack_int4
from engine_worker.model.int8 import Int8Embedding, Int8Linear
from engine_worker.model.matmul_plan import ALL, MatmulPlan, Route
from engine_worker.model.quant import (
    decode_read_bytes,
    pick_group_size,
    quantize_model,
    weight_bytes,
)
from engine_worker.model.quant_group import Int8GroupEmbedding, Int8GroupLinear
from engine_worker.model.weights import load_model

HAS_INT8_KERNEL = hasattr(torch, "_weight_int8pack_mm")
HAS_INT4_KERNEL = hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def only(path: str, dtype: torch.dtype | None = None) -> tuple[Route, ...]:
    """One path at every row count (the scales in `dtype`, else the weights')."""
    return (Route(ALL, path, str(dtype).removeprefix("torch.") if dtype else ""),)


def gaussian(n: int, k: int, seed: int = 0, std: float = 0.02) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * std


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


# --- INT8 ---------------------------------------------------------------------------------

@pytest.mark.parametrize("use_kernel", [False, pytest.param(True, marks=pytest.mark.skipif(
    not HAS_INT8_KERNEL, reason="no int8 kernel"))])
def test_int8_cosine_on_random_inputs(use_kernel: bool) -> None:
    w, b = gaussian(384, 576), torch.randn(384) * 0.01
    x = torch.randn(32, 576, generator=torch.Generator().manual_seed(1))
    q = Int8Linear.from_float(w, b, routes=only("int8", torch.bfloat16) if use_kernel
                              else only("dequantize"))
    assert cosine(q(x), F.linear(x, w, b)) > 0.998


def test_int8_per_channel_scale_is_absmax_over_127() -> None:
    w = gaussian(64, 128)
    q = Int8Linear.from_float(w, routes=only("dequantize", torch.float32))
    torch.testing.assert_close(q.scales, w.abs().amax(1) / 127)
    assert q.qweight.dtype == torch.int8 and q.qweight.abs().max() == 127
    err = (q.dequantize() - w).abs()
    assert (err <= q.scales[:, None] / 2 + 1e-7).all()


def test_int8_storage_at_most_055_of_float16() -> None:
    w = gaussian(576, 576)
    q = Int8Linear.from_float(w, routes=only("int8", torch.float32))  # float32 scales: the worst
    assert weight_bytes(q) <= 0.55 * w.numel() * 2


@pytest.mark.skipif(not HAS_INT8_KERNEL, reason="no int8 kernel")
@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
def test_int8_kernel_matches_fallback(compute_dtype: torch.dtype) -> None:
    w, x = gaussian(256, 192), torch.randn(5, 192)
    fast = Int8Linear.from_float(w, routes=only("int8", compute_dtype))
    slow = Int8Linear.from_float(w, routes=only("dequantize", compute_dtype))
    assert torch.equal(fast.qweight, slow.qweight)
    tol = 1e-4 if compute_dtype == torch.float32 else 2e-2  # bf16 activations: ~3 digits
    torch.testing.assert_close(fast(x), slow(x), rtol=tol, atol=tol)
    assert fast(x).dtype == torch.float32


# --- INT4 ---------------------------------------------------------------------------------

def test_pack_unpack_roundtrip() -> None:
    q = torch.randint(0, 16, (16, 64), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (16, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), q)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_storage_is_half_byte_plus_scales_and_zeros(group: int) -> None:
    n, k = 256, 1536
    q = Int4GroupLinear.from_float(gaussian(n, k), group_size=group)
    assert q.qweight.dtype == torch.uint8 and q.qweight.numel() == n * k // 2
    item = q.scales_zeros.element_size()
    assert weight_bytes(q) == n * k // 2 + (k // group) * n * 2 * item


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_dequantized_within_half_a_step(group: int) -> None:
    n, k = 128, 512
    w = gaussian(n, k, seed=group) + torch.linspace(-0.05, 0.05, k)  # groups off-centre too
    q = Int4GroupLinear.from_float(w, group_size=group, routes=only("dequantize", torch.float32))
    scale = q.scales_zeros[..., 0].t().repeat_interleave(group, dim=1)  # (N, K)
    err = (q.dequantize() - w).abs()
    assert (err <= scale / 2 * (1 + 1e-5) + 1e-7).all()
    assert cosine(q.dequantize(), w) > 0.99


@pytest.mark.skipif(not HAS_INT4_KERNEL, reason="no int4 kernel")
@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [32, 64])
def test_int4_kernel_matches_fallback(compute_dtype: torch.dtype, group: int) -> None:
    w, x = gaussian(320, 576), torch.randn(7, 576)
    fast = Int4GroupLinear.from_float(w, group_size=group, routes=only("int4", compute_dtype))
    slow = Int4GroupLinear.from_float(w, group_size=group,
                                      routes=only("dequantize", compute_dtype))
    assert fast.use_kernel and not slow.use_kernel
    assert torch.equal(fast.scales_zeros, slow.scales_zeros)
    torch.testing.assert_close(fast.dequantize(), slow.dequantize(), rtol=1e-5, atol=1e-6)
    tol = 1e-4 if compute_dtype == torch.float32 else 3e-2
    torch.testing.assert_close(fast(x), slow(x), rtol=tol, atol=tol)


def test_int4_kernel_refused_shape_uses_fallback() -> None:
    w = gaussian(40, 64)  # N % 16 != 0: the CPU kernel cannot pack it
    q = Int4GroupLinear.from_float(w, group_size=32)
    assert not q.use_kernel
    x = torch.randn(3, 64)
    assert cosine(q(x), x @ w.t()) > 0.99


def test_group_size_fallback_for_576_wide_inputs_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert pick_group_size(576, 128) == 64 and pick_group_size(1536, 128) == 128
    assert pick_group_size(576, 32) == 32 and pick_group_size(48, 32) is None
    model = torch.nn.Sequential(torch.nn.Linear(576, 64), torch.nn.Linear(1536, 64))
    with caplog.at_level(logging.WARNING, logger="kestrel.quant"):
        report = quantize_model(model, "int4", 128)
    assert report.group_sizes == {"0": 64, "1": 128}
    assert report.fallbacks == {(576, 64): ["0"]}
    assert "group 128 does not divide in_features 576" in caplog.text


# --- the model --------------------------------------------------------------------------

@pytest.mark.parametrize("mode,min_cos", [("int8", 0.999), ("int4", 0.97)])
def test_quantize_tiny_model_logits(tiny_dir: Path, mode: str, min_cos: float) -> None:
    model = load_model(tiny_dir, torch.float32, "cpu", max_positions=64)
    from engine_worker.model.attention import AttnMeta, PrefillSpan

    ids = torch.randint(0, 49152, (24,), generator=torch.Generator().manual_seed(0))
    meta = AttnMeta(slot_mapping=None, prefills=[PrefillSpan(0, 24, 0)])
    with torch.inference_mode():
        ref = model(ids, torch.arange(24), meta, None)
        report = quantize_model(model, mode, 32)
        out = model(ids, torch.arange(24), meta, None)
    # tied: float table freed; INT4's head is group-wise INT8 (Q8_0's rule), shared with the
    # embedding, the bulk of this tiny model
    embed = Int8Embedding if mode == "int8" else Int8GroupEmbedding
    assert isinstance(model.model.embed_tokens, embed)
    if mode == "int4":
        assert isinstance(model.lm_head, Int8GroupLinear)
        assert model.model.embed_tokens.table is model.lm_head
    assert report.bytes_after < report.bytes_before * (0.3 if mode == "int8" else 0.45)
    assert report.bytes_after == weight_bytes(model) and not report.skipped
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert cosine(out, ref) > min_cos


def test_quantize_without_lm_head_keeps_float_embedding(tiny_dir: Path) -> None:
    model = load_model(tiny_dir, torch.float32, "cpu", max_positions=64)
    quantize_model(model, "int8", lm_head=False)
    assert model.lm_head is None and isinstance(model.model.embed_tokens, torch.nn.Embedding)
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, Int8Linear)


def test_quantize_rejects_unknown_mode_and_group() -> None:
    with pytest.raises(ValueError):
        quantize_model(torch.nn.Linear(32, 32), "fp8")
    with pytest.raises(ValueError):
        quantize_model(torch.nn.Linear(32, 32), "int4", 48)


@pytest.mark.smollm
def test_int8_cosine_on_smollm2_layers(smollm2_dir: Path) -> None:
    """Real weights and real activations: inputs captured at each projection of a prompt."""
    model = load_model(smollm2_dir, torch.float32, "cpu", max_positions=64)
    from engine_worker.model.attention import AttnMeta, PrefillSpan

    layers = {n: m for n, m in model.named_modules()
              if isinstance(m, torch.nn.Linear) and n.startswith(("model.layers.0.",
                                                                  "model.layers.29."))}
    seen: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_hook(lambda mod, a, out, n=n: seen.__setitem__(n, a[0]))
             for n, m in layers.items()]
    ids = torch.randint(100, 40000, (32,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        model(ids, torch.arange(32), AttnMeta(None, prefills=[PrefillSpan(0, 32, 0)]), None)
    for h in hooks:
        h.remove()
    assert len(seen) == 8
    for name, mod in layers.items():
        q = Int8Linear.from_float(mod.weight, mod.bias)
        x = seen[name]
        assert cosine(q(x), mod(x)) > 0.998, name
        xr = torch.randn_like(x)
        assert cosine(q(xr), mod(xr)) > 0.998, name


def test_group_int8_from_float_follows_q8_0() -> None:
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(3))
    w[5, 40] = 30.0  # one outlier: only its own group of 32 gets the coarse scale
    q = Int8GroupLinear.from_float(w, routes=MatmulPlan(use_kernel=False).routes("int8_groups"))
    deq = q.dequantize()
    err = (deq - w).abs().view(64, 3, 32).amax(-1)  # (N, G): within half a step per group
    step = q.scales.t()  # (N, G)
    assert bool((err <= step / 2 + 1e-6).all())
    assert float(step[5, 1]) > 10 * float(step[5, 0])  # the outlier's group alone is coarse
    assert torch.equal(q.scales, q.scales.half().float())  # stored as a Q8_0 file would


@pytest.mark.parametrize("tied", [True, False])
def test_a_decode_step_reads_every_weight_but_the_embedding_table(tmp_path: Path,
                                                                  tied: bool) -> None:
    """Issue 53: the bytes one decode step of one sequence reads: all weights, of the embedding
    table one row, unless the head reads the same table whole (tied)."""
    from engine_worker.model.tiny import make_tiny_checkpoint

    folder = make_tiny_checkpoint(tmp_path / "tiny", tie_word_embeddings=tied)
    model = load_model(folder, torch.float32, "cpu", max_positions=64)
    table = model.model.embed_tokens.weight
    held = weight_bytes(model)
    row = table.nbytes // table.shape[0]
    assert decode_read_bytes(model) == (held if tied else held - table.nbytes + row)
    assert decode_read_bytes(model) < held or tied
