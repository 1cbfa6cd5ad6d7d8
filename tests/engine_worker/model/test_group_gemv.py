"""The C++ few-row Q8_0 kernel (csrc/group_gemv.cpp) against dequantize-then-matmul, the layer
in its native layout against torch's per-group layout, the GGUF tiny model's logits with and
without it (teacher-forced, within bfloat16 rounding), and the fallback when no kernel builds."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch

from engine_worker import kernel_build
from engine_worker.kernel_build import KernelUnavailable
from engine_worker.model.attention import AttnMeta, PrefillSpan
from engine_worker.model.gguf_native import load_gguf_model
from engine_worker.model.loader import load_config
from engine_worker.model.matmul_plan import MatmulPlan
from engine_worker.model.quant_group import Int8GroupLinear, load_group_gemv
from engine_worker.model_runner import ModelRunner
from engine_worker.runner_config import RunnerConfig
from engine_worker.step import StepItem
from tests.engine_worker.gguf_factory import write_gguf
from tests.numerics import BF16_ULPS, assert_logits_close

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def kernel(cache_dir: Path) -> None:
    why = load_group_gemv(cache_dir)  # the runners' own build, made once per cache dir
    if why is not None:
        pytest.skip(f"the group_gemv kernel is not available here: {why}")


def _layer(n: int, k: int, seed: int, native: bool, dense_min_rows: int = 0) -> Int8GroupLinear:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scales = torch.rand(n, k // 32, generator=g) / 50
    plan = MatmulPlan(native_q8=native, head_dense_rows=dense_min_rows)
    return Int8GroupLinear(codes, scales, plan.routes("int8_groups", True))


@pytest.mark.parametrize("rows", [1, 2, 3, 8])
@pytest.mark.parametrize("n,k", [(96, 64), (1000, 576), (37, 1536)])
def test_q8_group_mm_equals_dequantized_matmul(kernel: None, rows: int, n: int, k: int) -> None:
    layer = _layer(n, k, rows + n, native=True)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(n))
    want = (x.double() @ layer.dequantize().double().t()).float()  # (M, N)
    got = torch.ops.kestrel.q8_group_mm(x, layer.codes, layer.scales)
    # float32 arithmetic in another order than the float64 reference: a few ulps of the sum
    torch.testing.assert_close(got, want, atol=1e-4 * k ** 0.5, rtol=1e-5)
    torch.testing.assert_close(layer(x), want, atol=1e-4 * k ** 0.5, rtol=1e-5)


def test_q8_group_mm_rejects_bad_shapes(kernel: None) -> None:
    layer = _layer(64, 64, 0, native=True)
    with pytest.raises(RuntimeError, match="1..8 rows"):
        torch.ops.kestrel.q8_group_mm(torch.randn(9, 64), layer.codes, layer.scales)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.kestrel.q8_group_mm(torch.randn(1, 32), layer.codes, layer.scales)
    with pytest.raises(RuntimeError, match="scales"):
        torch.ops.kestrel.q8_group_mm(torch.randn(1, 64), layer.codes, layer.scales.t())


def test_native_layout_equals_torch_layout(kernel: None) -> None:
    """Same codes and scales in both layouts: same weights, same embedding rows, and outputs
    within the torch path's bfloat16 rounding; many rows without a dense copy work too."""
    native, grouped = _layer(200, 96, 7, True), _layer(200, 96, 7, False)
    assert torch.equal(native.dequantize(), grouped.dequantize())
    ids = torch.tensor([199, 0, 42, 42])
    assert torch.equal(native.rows(ids, torch.float32), grouped.rows(ids, torch.float32))
    for rows in (1, 3, 12):  # 12 > the kernel's 8: one transient bfloat16 matrix
        x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
        want = x @ native.dequantize().t()
        tol = 0.02 * want.abs().max().item()
        torch.testing.assert_close(native(x), want, atol=tol, rtol=0.02)
        torch.testing.assert_close(grouped(x), want, atol=tol, rtol=0.02)


def test_gguf_tiny_model_logits_with_kernel_within_bf16_of_torch_path(
    kernel: None, tiny_dir: Path, tmp_path: Path,
) -> None:
    cfg = load_config(tiny_dir)
    path = write_gguf(tiny_dir, tmp_path / "tiny.gguf", Q.Q4_1, Q.Q8_0, cfg.num_heads,
                      cfg.num_kv_heads)
    rows = {}
    ids = [1, 504, 3458, 282]
    for native in (False, True):  # the torch path first: its greedy tokens feed both
        plan = MatmulPlan(dense_min_rows=4, head_dense_rows=4, native_q8=native)
        model = load_gguf_model(path, cfg, "cpu", plan=plan)
        assert model.lm_head.native is native  # type: ignore[union-attr]
        out = []
        with torch.inference_mode():
            for step in range(24):  # the last row only: one row through the head's kernel
                n = 4 + step
                meta = AttnMeta(slot_mapping=None, prefills=[PrefillSpan(0, n, 0)])
                logits = model(torch.tensor(ids[:n]), torch.arange(n), meta, None,
                               torch.tensor([n - 1]))  # (1, V)
                out.append(logits[0].float())
                if not native:
                    ids.append(int(logits[0].argmax()))
        rows[native] = torch.stack(out)  # (24, V), teacher-forced on the reference's tokens
    # The tiny random model's logits are flat (top-two gaps of 0.02-0.3 nats) and the torch path
    # rounds activations to bfloat16: the kernel's logits within a few bfloat16 steps of the
    # largest, and the same greedy token wherever the reference is not tied within that.
    assert_logits_close(rows[True], rows[False], ulps=BF16_ULPS)


def test_runner_falls_back_when_no_kernel_can_be_built(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    def refuse(name: str, cache_dir: str, op: str, seconds: int = 15) -> None:
        raise KernelUnavailable("no C++ compiler ('c++' not found)")

    monkeypatch.setattr("engine_worker.model.quant_group.load_kernel", refuse)
    monkeypatch.setattr("engine_worker.int_dot.load_kernel", refuse)  # nor the integer-dot one
    cfg = load_config(tiny_dir)
    path = write_gguf(tiny_dir, tmp_path / "tiny.gguf", Q.Q4_1, Q.Q8_0, cfg.num_heads,
                      cfg.num_kv_heads)
    runner = ModelRunner(RunnerConfig(tiny_dir, gguf_path=path, kv_budget_bytes=1 << 22,
                                      cache_dir=tmp_path))
    assert runner.model.lm_head.native is False  # type: ignore[union-attr]
    logits = runner.execute([StepItem([1, 2, 3], 0, [0])])
    assert logits.shape == (1, cfg.vocab_size) and bool(torch.isfinite(logits).all())


def test_compiler_missing_names_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "no-such-compiler-kestrel")
    why = kernel_build.compiler_missing()
    assert why == "no C++ compiler ('no-such-compiler-kestrel' not found)"
