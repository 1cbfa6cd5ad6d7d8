"""One factory for both weight paths (issue 53): a GGUF tensor's blocks and a float checkpoint's
matrix end in the same table (model/linear_factory.py), so a kind's layer is built one way."""

from __future__ import annotations

import gguf
import pytest
import torch

from engine_worker.model.ggml_types import Blocks
from engine_worker.model.int4 import Int4GroupLinear
from engine_worker.model.int8 import Int8Linear
from engine_worker.model.int_dot_linear import IntDotLinear
from engine_worker.model.layers import Linear
from engine_worker.model.linear_factory import LAYERS, ROUNDING, from_blocks, from_float
from engine_worker.model.matmul_plan import MatmulPlan
from engine_worker.model.quant_group import Int8GroupLinear
from tests.engine_worker.kquant_factory import quantize

CPU = torch.device("cpu")
N, K = 32, 128


def exact_q8_0_floats(seed: int) -> torch.Tensor:
    """A (N, K) matrix that Q8_0's rule holds exactly: per group of 32 a float16 scale times
    integer codes, one of them 127, so any Q8_0 writer finds the same scale and codes."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (N, K // 32, 32), generator=g)
    codes[..., 0] = 127
    scales = (torch.rand(N, K // 32, 1, generator=g) * 0.02 + 1e-3).half().float()
    return (codes * scales).view(N, K)


def behind(layer: torch.nn.Module) -> torch.nn.Module:
    """The layer torch's kernels serve: itself, or the one behind the integer-dot kernel."""
    return layer.fallback if isinstance(layer, IntDotLinear) else layer


def test_a_q8_0_tensor_and_its_floats_rounded_as_q8_0_build_the_same_layer() -> None:
    w = exact_q8_0_floats(0)
    plan = MatmulPlan(device="cpu", int_dot_rows=0)  # no kernel in front: torch's layer only
    raw = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0)
    from_file = from_blocks(Blocks("q8_0", raw, N, K), plan, CPU)
    routes = plan.routes("int8_groups")
    from_floats = from_float(w, None, "int8_groups", routes)
    assert type(from_file) is type(from_floats) is Int8GroupLinear
    assert from_file.routes == from_floats.routes == routes
    assert torch.equal(from_file.codes, from_floats.codes)
    assert torch.equal(from_file.scales, from_floats.scales)
    x = torch.randn(3, K)
    assert torch.equal(from_file(x), from_floats(x))


@pytest.mark.parametrize(("kind", "cls"), [("int8", Int8Linear), ("int8_groups", Int8GroupLinear),
                                           ("int4", Int4GroupLinear)])
def test_each_kind_is_one_row_of_rounding_and_one_of_layers(kind: str, cls: type) -> None:
    """A kind's rounding rule and its layer are rows of the factory's two tables; the layer
    takes the routes it was given and computes the matrix its codes stand for."""
    assert kind in ROUNDING and kind in LAYERS
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(1)) * 0.05
    bias = torch.randn(N) if kind != "int8_groups" else None
    plan = MatmulPlan(device="cpu")
    routes = plan.routes(kind)
    layer = from_float(w, bias, kind, routes)
    assert type(layer) is cls and layer.routes == routes
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(2))
    want = x @ layer.dequantize(torch.float32).T + (0 if bias is None else bias)
    assert torch.allclose(layer(x), want, atol=3e-2, rtol=3e-2)
    err = (layer.dequantize(torch.float32) - w).abs().max()
    assert err <= (w.abs().max() / (7 if kind == "int4" else 100))  # rounded, not made up


def test_gguf_formats_build_the_kind_their_table_row_names() -> None:
    """Q4_0 -> int4's layer, Q8_0 -> int8_groups', Q6_K (no form torch takes) -> the float
    matrix, each behind the integer-dot kernel where the plan puts it in front."""
    w = torch.randn(N, 256, generator=torch.Generator().manual_seed(3)).numpy()
    q = gguf.GGMLQuantizationType
    plan = MatmulPlan(device="cpu", int_dot_rows=4)
    want = {"q4_0": (q.Q4_0, Int4GroupLinear), "q8_0": (q.Q8_0, Int8GroupLinear),
            "q6_k": (q.Q6_K, Linear)}
    for fmt, (qtype, cls) in want.items():
        layer = from_blocks(Blocks(fmt, quantize(w, qtype), N, 256), plan, CPU)
        assert isinstance(layer, IntDotLinear)
        assert type(behind(layer)) is cls, fmt
