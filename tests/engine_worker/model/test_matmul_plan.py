"""The matmul plan (engine_worker/model/matmul_plan.py): per weight kind, the path each row count
takes is what the code says; for a given file and a given measured choice, the runner's plan and
every layer it built are that; and nothing changes a module of the model after the build."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from engine_worker.model import builder
from engine_worker.model.int4 import Int4GroupLinear
from engine_worker.model.int_dot_linear import IntDotLinear
from engine_worker.model.layers import RMSNorm
from engine_worker.model.matmul_plan import MatmulPlan, describe_routes
from engine_worker.model.quant_group import Int8GroupLinear
from engine_worker.model_runner import ModelRunner
from engine_worker.path_choice import PathChoice
from engine_worker.runner_config import RunnerConfig
from engine_worker.step import StepItem
from tests.engine_worker.gguf_factory import write_gguf

Q = gguf.GGMLQuantizationType


def test_each_kind_routes_its_rows_as_the_plan_says() -> None:
    plan = MatmulPlan(int_dot_rows=8, dense_min_rows=64, head_dense_rows=64, native_q8=True,
                      kinds=("q4_1",), head_kind="q8_0", origin="measured")
    assert describe_routes(plan.routes("q4_1")) == \
        "int_dot 1-8, int4(bfloat16) 9-63, dense(bfloat16) 64+"
    # our Q8_0 kernel 8 rows a call up to 32, then one dequantized matrix until the copy
    assert describe_routes(plan.routes("q8_0", head=True)) == \
        "int_dot 1-8, q8 9-32, dequantize(bfloat16) 33-63, dense(bfloat16) 64+"
    assert plan.switch_rows() == (9, 33, 64)  # the compiled decode's bucket edges
    assert plan.describe() == (
        "matmul plan: q4_1: int_dot 1-8, int4(bfloat16) 9-63, dense(bfloat16) 64+; "
        "head q8_0: int_dot 1-8, q8 9-32, dequantize(bfloat16) 33-63, dense(bfloat16) 64+ "
        "(measured)")
    # K-quant files: the integer-dot kernel at every row count; float tensors stay float
    every = MatmulPlan(int_dot_all=True)
    assert describe_routes(every.routes("q6_16")) == "int_dot 1+"
    assert describe_routes(every.routes("float")) == "float 1+"
    # the exact mode, and an INT4 layer torch's kernel cannot tile, dequantize
    assert describe_routes(MatmulPlan(use_kernel=False).routes("q4_0")) == "dequantize 1+"
    assert describe_routes(MatmulPlan().routes("q4_0", fits=False)) == "dequantize 1+"
    # no GPU path of ours: on CUDA every quantized layer dequantizes
    assert describe_routes(MatmulPlan(device="cuda", int_dot_rows=8).routes("q4_0")) == \
        "dequantize 1+"
    # a float checkpoint's INT8 mode, INT4 mode and its group-wise INT8 head
    assert describe_routes(MatmulPlan().routes("int8")) == "int8(bfloat16) 1+"
    assert describe_routes(MatmulPlan(packed_dtype="float32").routes("int4")) == \
        "int4(float32) 1+"
    assert describe_routes(MatmulPlan(head_dense_rows=4).routes("int8_groups", True)) == \
        "int8_groups(bfloat16) 1-3, dense(bfloat16) 4+"


@pytest.fixture(scope="module")
def tiny_q4(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tiny_dir, tmp_path_factory.mktemp("plan") / "tiny.gguf", Q.Q4_1, Q.Q8_0)


@pytest.fixture(scope="module")
def planned(tiny_dir: Path, tiny_q4: Path) -> ModelRunner:
    """A runner of the Q4_1 file (a tied Q8_0 head) on this host's measured choice: given."""
    choice = PathChoice("bfloat16", "bfloat16", 64, True, {}, int_dot_rows=8, confirmed=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(builder, "choose_paths", lambda *args, **kwargs: choice)
        return ModelRunner(RunnerConfig(tiny_dir, gguf_path=tiny_q4, kv_budget_bytes=1 << 22))


def test_a_file_and_a_measured_choice_give_this_plan_and_these_layers(
        planned: ModelRunner) -> None:
    plan = planned.plan
    assert plan.describe().startswith(
        "matmul plan: q4_1: int_dot 1-8, int4(bfloat16) 9-63, dense(bfloat16) 64+; "
        "head q8_0: int_dot 1-8, ")
    assert plan.describe().endswith("(cached)")  # a confirmed choice, read back
    for layer in planned.model.model.layers:
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                    layer.mlp.down_proj):
            assert isinstance(lin, IntDotLinear) and lin.max_rows == 8
            assert isinstance(lin.fallback, Int4GroupLinear)
            assert lin.fallback.routes == plan.routes("q4_1")[1:]
            assert lin.fallback.dense is not None and lin.fallback.dense.dtype == torch.bfloat16
    head = planned.model.lm_head
    assert isinstance(head, IntDotLinear) and isinstance(head.fallback, Int8GroupLinear)
    assert head.fallback.routes == plan.routes("q8_0", head=True)[1:]
    # every decoder layer on the integer-dot kernel: decode rows through the C++ stack where it
    # loads, and then every norm with its numerics, from the build on
    assert plan.decode_stack == (planned.decode_stack is not None)
    norms = [m for m in planned.model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(n.kernel == plan.decode_stack for n in norms)
    if planned.compiled is None:
        assert plan.switch_rows() == (9, 33, 64)


def _state(model: torch.nn.Module) -> dict[tuple[str, str], Any]:
    """Every attribute of every module: tensors by identity (and version), the rest by value."""

    def seen(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return ("tensor", id(v), v._version)
        if isinstance(v, dict):
            return {k: seen(x) for k, x in v.items()}
        if isinstance(v, (tuple, list)):
            return tuple(seen(x) for x in v)
        if isinstance(v, (bool, int, float, str, type(None), torch.dtype)):
            return v
        return ("object", id(v))

    return {(name, key): seen(value) for name, mod in model.named_modules()
            for key, value in vars(mod).items() if key != "_modules"}


def test_no_module_changes_after_the_build(planned: ModelRunner) -> None:
    before = _state(planned.model)

    def run(*items: StepItem) -> None:
        planned.execute(list(items))
        changed = [k for k, v in _state(planned.model).items() if before.get(k) != v]
        assert not changed, changed[:5]

    run(StepItem(list(range(1, 21)), 0, [0, 1]), StepItem(list(range(1, 10)), 0, [2]))
    decode = [StepItem([5], 20, [0, 1]), StepItem([6], 9, [2])]
    run(*decode, StepItem(list(range(1, 40)), 0, [3, 4, 5]))  # decode and prefill rows
    if planned.decode_stack is not None:  # the runner's own switches, not the modules'
        planned.set_decode_stack(False)
        run(*decode)
        planned.set_decode_stack(True)
    if planned.paged_attention.enabled:
        planned.set_paged_attention(False)
        run(*decode)
        planned.set_paged_attention(True)
    run(*decode)


def test_a_path_left_no_rows_is_not_in_the_table() -> None:
    # measured on a Zen 5: the integer-dot kernel up to 16 rows, a copy from 16: the packed
    # kernel behind the first takes no row count, and the copy starts at 17
    plan = MatmulPlan(int_dot_rows=16, dense_min_rows=16, kinds=("q4_1",))
    assert describe_routes(plan.routes("q4_1")) == "int_dot 1-16, dense(bfloat16) 17+"
    assert plan.switch_rows() == (17,)
    # a copy from the first row: the packed kernel is held, and never runs
    assert describe_routes(MatmulPlan(dense_min_rows=1).routes("q4_0")) == "dense(bfloat16) 1+"
