"""Tests for engine_worker/path_choice.py: the compute path of GGUF-native layers is chosen on
the host by measurement, among the candidates the CPU has instructions for, kept in the cache
dir under a key of the CPU, torch, the ISA caps and the shapes, and read back without timing."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import torch

from engine_worker import path_choice
from engine_worker.model.int_dot_linear import IntDotLinear
from engine_worker.model.matmul_plan import ALL, Route
from engine_worker.model_runner import ModelRunner
from engine_worker.path_choice import choose_paths, decide, native_bf16
from engine_worker.runner_config import AUTO, RunnerConfig
from engine_worker.step import StepItem
from tests.engine_worker.gguf_factory import write_gguf

Q = gguf.GGMLQuantizationType


def rows(*ms: float) -> dict[str, float]:
    return {str(r): m for r, m in zip((1, 2, 4, 8, 16, 32, 64, 128), ms, strict=False)}


def test_decide_takes_the_faster_packed_dtype_and_a_copy_only_where_it_keeps_winning() -> None:
    timings = {
        "packed-bfloat16": rows(1, 1, 2, 3, 5, 9, 17, 33),
        "packed-float32": rows(20),  # stopped early: hopeless
        "dense-float32": rows(2, 2, 3, 3, 6, 8, 9, 10),  # wins from 32 rows on (16 is noise)
    }
    choice = decide(timings, bf16=False)
    assert (choice.compute_dtype, choice.dense_dtype, choice.dense_min_rows) == \
        ("bfloat16", "float32", 32)
    never = {**timings, "dense-float32": rows(2, 2, 3, 4, 6, 10, 18, 40)}
    assert decide(never, bf16=False).dense_min_rows == 0
    both = {**timings, "dense-bfloat16": rows(2, 2, 2, 2, 4, 7, 8, 9)}
    choice = decide(both, bf16=True)  # the copy faster at the most rows
    assert (choice.dense_dtype, choice.dense_min_rows) == ("bfloat16", 8)
    assert "a bfloat16 copy from 8 rows" in choice.describe()


def test_the_integer_dot_kernel_serves_up_to_where_it_stops_winning() -> None:
    base = {"packed-bfloat16": rows(1, 1, 2, 3, 5, 9, 17, 33),
            "dense-float32": rows(2, 2, 3, 3, 6, 8, 9, 10)}
    # rows 1, 2, 4, 8, 16, 32, 64, 128: faster up to 8 rows, then not (at 16: 5 > 3)
    choice = decide({**base, "int_dot": rows(0.5, 0.6, 1, 2, 5, 1, 1, 1)}, bf16=False)
    assert choice.int_dot_rows == 8 and "integer-dot kernel up to 8 rows" in choice.describe()
    # faster at every row count measured: every row count, so a step's rows never change path
    # (before, never past 16 rows, however fast it was timed there)
    everywhere = decide({**base, "int_dot": rows(0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1)},
                        bf16=False)
    assert everywhere.int_dot_rows == 128 and everywhere.int_dot_everywhere
    assert "integer-dot kernel at every row count" in everywhere.describe()
    assert not choice.int_dot_everywhere
    # slower at one row: not used at all, even where it wins later
    assert decide({**base, "int_dot": rows(1.5, 0.1, 0.1, 0.1, 0.1, 9, 9, 9)},
                  bf16=False).int_dot_rows == 0
    assert decide(base, bf16=False).int_dot_rows == 0  # not a candidate (no kernel here)


def test_bfloat16_is_native_only_with_its_instructions_and_no_cap(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for var in path_choice.CAP_VARS:
        monkeypatch.delenv(var, raising=False)
    assert not native_bf16("fpu avx2 fma avx512f avx512_vnni")  # Ice Lake, Zen 3: no
    assert native_bf16("fpu avx2 avx512f avx512_bf16")
    assert native_bf16("fpu amx_bf16 amx_tile")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")  # proving the AVX2 path on this host
    assert not native_bf16("fpu avx2 avx512f avx512_bf16")


@pytest.fixture(scope="module")
def tiny_q4(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tiny_dir, tmp_path_factory.mktemp("paths") / "tiny.gguf", Q.Q4_1, Q.Q8_0)


def test_choice_is_measured_until_two_starts_agree_then_read_from_the_cache_dir(
        tiny_q4: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="kestrel.paths"):
        first = choose_paths(tiny_q4, tmp_path, num_layers=2)
    assert "measured in" in caplog.text and not first.confirmed
    [saved] = (tmp_path / "paths").glob("*.json")
    timed = json.loads(saved.read_text())["timings_ms"]
    assert {"packed-bfloat16", "packed-float32", "dense-float32"} <= set(timed)
    assert ("dense-bfloat16" in timed) == native_bf16()  # no emulated bfloat16 copy
    assert first.compute_dtype in ("bfloat16", "float32")

    # the next start measures again; the same paths chosen: confirmed, and kept from then on
    monkeypatch.setattr(path_choice, "measure", lambda *_a, **_k: first.timings_ms)
    second = choose_paths(tiny_q4, tmp_path, num_layers=2)
    assert second.confirmed and second.same_paths(first)

    def no_timing(*_a: object, **_k: object) -> None:
        raise AssertionError("measured again")

    monkeypatch.setattr(path_choice, "measure", no_timing)
    assert choose_paths(tiny_q4, tmp_path, num_layers=2) == second
    # Another ISA cap is another host as far as the choice goes: its own key.
    monkeypatch.setenv("KESTREL_CPU_ISA", "native-for-this-test")
    with pytest.raises(AssertionError, match="measured again"):
        choose_paths(tiny_q4, tmp_path, num_layers=2)


def timings(copy_from: int) -> dict[str, dict[str, float]]:
    """Made-up timings: the packed bfloat16 path fastest below `copy_from` rows, the float32
    copy from there on."""
    rows = (*path_choice.DECODE_ROWS, *path_choice.PREFILL_ROWS)
    return {"packed-bfloat16": {str(r): float(r) for r in rows},
            "packed-float32": {str(r): 2.0 * r for r in rows},
            "dense-float32": {str(r): (0.5 if r >= copy_from else 3.0) * r for r in rows}}


def test_a_choice_the_next_start_disagrees_with_is_measured_again(
        tiny_q4: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One busy start's choice (a copy from 8 rows) is not kept for good: the next start chose
    a copy from 16 rows, so the start after it measures once more, and agrees."""
    for copy_from, confirmed in ((8, False), (16, False), (16, True)):
        monkeypatch.setattr(path_choice, "measure", lambda *_a, c=copy_from, **_k: timings(c))
        choice = choose_paths(tiny_q4, tmp_path, num_layers=2)
        assert (choice.dense_min_rows, choice.confirmed) == (copy_from, confirmed)


def test_a_copy_over_the_memory_budget_is_no_candidate(tiny_q4: Path, tmp_path: Path) -> None:
    small = choose_paths(tiny_q4, tmp_path, num_layers=2, copy_budget=1000)
    assert set(small.timings_ms) == {"packed-bfloat16", "packed-float32"}
    assert small.dense_min_rows == 0 and small.dense_dtype == ""


def test_runner_serves_with_the_measured_choice(tiny_dir: Path, tiny_q4: Path,
                                                cache_dir: Path) -> None:
    runner = ModelRunner(RunnerConfig(tiny_dir, gguf_path=tiny_q4, kv_budget_bytes=1 << 22,
                                      dense_min_rows=AUTO,
                                      cache_dir=cache_dir))  # the kernels built once
    assert runner.paths is not None
    layer = runner.model.model.layers[0].mlp.down_proj
    logits = runner.execute([StepItem(list(range(1, 40)), 0, [0, 1, 2])])
    assert logits.shape == (1, runner.config.vocab_size) and torch.isfinite(logits).all()
    if runner.paths.int_dot_everywhere:  # it won at every row count measured: nothing behind it
        assert runner.plan.routes("q4_1") == (Route(ALL, "int_dot"),)
        assert isinstance(layer, IntDotLinear) and layer.fallback is None
        assert layer.max_rows == ALL
        return
    if runner.paths.int_dot_rows:  # the integer-dot kernel up to its rows, over the packed path
        assert isinstance(layer, IntDotLinear) and layer.max_rows == runner.paths.int_dot_rows
        layer = layer.fallback
    # the copy from its measured row count, or from the first row past the integer-dot kernel
    want = runner.paths.dense_min_rows and max(runner.paths.dense_min_rows,
                                               runner.paths.int_dot_rows + 1)
    routes = runner.plan.routes("q4_1")  # this file's layers
    starts = {r.path: routes[i - 1].upto + 1 if i else 1 for i, r in enumerate(routes)}
    assert starts.get("dense", 0) == want and (layer.dense is not None) == bool(want)
    if want:
        assert layer.dense.dtype == getattr(torch, runner.paths.dense_dtype)
