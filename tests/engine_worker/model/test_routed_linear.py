"""RoutedLinear: a layer's forward is its routes' table, and a route it cannot run is refused
when the layer is built, not when a batch of that size first arrives."""

from __future__ import annotations

import pytest
import torch

from engine_worker.model.int4 import Int4GroupLinear
from engine_worker.model.int8 import Int8Linear
from engine_worker.model.int_dot_linear import IntDotLinear
from engine_worker.model.matmul_plan import ALL, Route
from engine_worker.model.quant_group import Int8GroupLinear
from engine_worker.model.routed_linear import RoutedLinear


class Two(RoutedLinear):
    """Rows take path a or b by the routes; a and b say which ran."""

    def __init__(self, routes: tuple[Route, ...]) -> None:
        super().__init__()
        self.in_features, self.out_features = 4, 2
        self.register_buffer("bias", torch.tensor([10.0, 20.0]))
        self.register_buffer("dense", None)
        self.set_routes(routes)

    def _a(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_full((x.shape[0], 2), 1.0)

    def _b(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_full((x.shape[0], 2), 2.0)


def test_forward_takes_the_path_of_the_first_route_that_holds_the_rows_and_adds_the_bias(
        ) -> None:
    layer = Two((Route(3, "a"), Route(ALL, "b")))
    assert torch.equal(layer(torch.zeros(3, 4)), torch.tensor([[11.0, 21.0]] * 3))
    assert torch.equal(layer(torch.zeros(4, 4)), torch.tensor([[12.0, 22.0]] * 4))
    assert "a 1-3, b 4+" in repr(layer)


def test_a_route_the_layer_has_no_path_for_is_refused_at_build() -> None:
    with pytest.raises(ValueError, match="no path c"):
        Two((Route(3, "a"), Route(ALL, "c")))


def test_every_format_layer_is_one_routed_linear() -> None:
    w = torch.randn(16, 64)
    layers = [Int8Linear.from_float(w, routes=(Route(ALL, "dequantize"),)),
              Int8GroupLinear.from_float(w, routes=(Route(ALL, "dequantize"),)),
              Int4GroupLinear.from_float(w, group_size=32, routes=(Route(ALL, "dequantize"),))]
    assert all(isinstance(m, RoutedLinear) for m in layers)
    assert issubclass(IntDotLinear, RoutedLinear)
    x = torch.randn(2, 64)
    for m in layers:  # each computes its own matrix (INT4's within its coarser steps)
        y = m(x)
        assert y.shape == (2, 16)
        assert torch.nn.functional.cosine_similarity(y.flatten(), (x @ w.t()).flatten(),
                                                     dim=0) > 0.98
