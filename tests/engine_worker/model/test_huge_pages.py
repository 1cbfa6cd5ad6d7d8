"""The packed weights in 2 MiB pages (engine_worker/model/huge_pages.py): moved into one map
advised MADV_HUGEPAGE, every result the same bits, and kept in the file maps with
--huge-pages off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_worker.model import huge_pages
from engine_worker.model.gguf_native import load_gguf_model
from engine_worker.model.int_dot_linear import IntDotLinear
from engine_worker.model.loader import load_config
from engine_worker.model.matmul_plan import MatmulPlan
from engine_worker.model_runner import ModelRunner
from engine_worker.runner_config import RunnerConfig
from engine_worker.step import StepItem
from tests.engine_worker.model.test_gguf_native import PROMPT, _logits, tiny_gguf  # noqa: F401

needs_thp = pytest.mark.skipif(huge_pages.where() is not None,
                               reason=f"no huge pages here: {huge_pages.where()}")


def _packed(model: torch.nn.Module) -> list[torch.Tensor]:
    return [t for m in model.modules() if isinstance(m, IntDotLinear)
            for t in (m.packed.qs, m.packed.d, m.packed.m) if t is not None]


@needs_thp
def test_an_arena_starts_on_a_huge_page_boundary_in_a_map_advised_huge() -> None:
    room = huge_pages.arena(3 << 20)
    assert room.data_ptr() % huge_pages.PAGE == 0 and room.numel() == 3 << 20
    assert "hg" in huge_pages.backing(room)["VmFlags"].split()
    assert int(room.sum()) == 0  # zeroed, as an anonymous map is


@needs_thp
def test_adopted_layers_give_the_same_bits_from_one_huge_page_map(
        int_dot_kernel: None, tiny_gguf: tuple[Path, Path]) -> None:  # noqa: F811
    path, ref = tiny_gguf
    model = load_gguf_model(path, load_config(ref), "cpu", plan=MatmulPlan(int_dot_rows=16))
    before = _logits(model, PROMPT)
    old = _packed(model)
    moved = huge_pages.adopt(model)
    new = _packed(model)
    assert moved >= sum(t.nbytes for t in new) and len(new) == len(old)
    for a, b in zip(old, new, strict=True):
        assert a.data_ptr() != b.data_ptr() and torch.equal(a, b) and b.dtype == a.dtype
    lo = min(t.data_ptr() for t in new)
    assert lo % huge_pages.PAGE == 0  # the first tensor opens the aligned map
    assert all("hg" in huge_pages.backing(t)["VmFlags"].split() for t in new)
    torch.testing.assert_close(_logits(model, PROMPT), before, rtol=0, atol=0)


def test_huge_pages_off_keeps_the_file_maps(tiny_gguf: tuple[Path, Path],  # noqa: F811
                                            cache_dir: Path) -> None:
    path, ref = tiny_gguf
    runner = ModelRunner(RunnerConfig(ref, gguf_path=path, kv_budget_bytes=1 << 22,
                                      requantize="q4_0", huge_pages="off", cache_dir=cache_dir))
    packed = _packed(runner.model)
    assert packed and not any("hg" in huge_pages.backing(t).get("VmFlags", "").split()
                              for t in packed)


@needs_thp
def test_a_runner_on_a_gguf_serves_its_layers_from_huge_pages(
        tiny_gguf: tuple[Path, Path], cache_dir: Path) -> None:  # noqa: F811
    """End to end through the runner a worker builds: the file's packed layers end up in the
    advised map with nothing to ask for, and a step runs on them. (Re-quantized, as a draft
    is: a tiny legacy file's own types may measure faster on torch's packed path.)"""
    path, ref = tiny_gguf
    runner = ModelRunner(RunnerConfig(ref, gguf_path=path, kv_budget_bytes=1 << 22,
                                      requantize="q4_0", cache_dir=cache_dir))
    packed = _packed(runner.model)
    assert packed and all("hg" in huge_pages.backing(t)["VmFlags"].split() for t in packed)
    logits = runner.execute([StepItem(list(range(1, 12)), 0, [0])])
    assert torch.isfinite(logits).all()
