"""The one linear module every weight format's layer is: its forward is its routes' table.

    built with routes (model/matmul_plan.py: "up to N rows -> path", chosen once for the layer's
    weight kind) -> forward(x (M, K)): the path for M rows is looked up and its method `_<path>`
    computes (M, N) -> plus the bias, if any

A format's layer (int8.py, int4.py, quant_group.py, int_dot_linear.py) holds its weights in the
layouts its routes need and one method per path it serves; the dispatch, the bias, the float
copy ("dense") and the description are here, once. Nothing changes a layer's routes after it is
built: the plan's line at start names every path any layer takes (MatmulPlan.describe).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine_worker.model.matmul_plan import Route, describe_routes, pick


class RoutedLinear(nn.Module):
    in_features: int
    out_features: int
    bias: torch.Tensor | None
    dense: torch.Tensor | None

    def set_routes(self, routes: tuple[Route, ...]) -> None:
        """Fix the layer's routes; every path they name must be a method `_<path>`."""
        missing = [r.path for r in routes if not callable(getattr(self, f"_{r.path}", None))]
        if missing:
            raise ValueError(f"{type(self).__name__} has no path {', '.join(missing)}")
        self.routes = routes
        self.paths = tuple((r.upto, f"_{r.path}") for r in routes)

    def path(self, rows: int) -> str:
        """The method that computes `rows` rows."""
        return pick(self.paths, rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = getattr(self, self.path(x.shape[0]))(x)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's float copy (kept where a "dense" route serves), through oneDNN."""
        assert self.dense is not None
        return F.linear(x.to(self.dense.dtype), self.dense).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, "
                f"routes={describe_routes(self.routes)}")
