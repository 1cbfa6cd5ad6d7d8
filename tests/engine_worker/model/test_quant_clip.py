"""INT4 clipping search: never worse than round-to-nearest per group, better on heavy tails."""

from __future__ import annotations

import torch

from engine_worker.model.int4 import Int4GroupLinear
from engine_worker.model.matmul_plan import ALL, Route


def test_clip_search_lowers_weight_error_on_heavy_tailed_weights() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.distributions.StudentT(3.0).sample((64, 256))  # heavy tails: outliers per group
    kw = {"group_size": 32, "routes": (Route(ALL, "dequantize", "float32"),)}
    rtn = Int4GroupLinear.from_float(w, **kw)
    clip = Int4GroupLinear.from_float(w, clip_search=True, **kw)
    err_rtn = ((rtn.dequantize() - w) ** 2).view(64, 8, 32).sum(-1)  # (N, groups)
    err_clip = ((clip.dequantize() - w) ** 2).view(64, 8, 32).sum(-1)
    assert (err_clip <= err_rtn + 1e-6).all()  # per group: the search keeps the better range
    assert err_clip.sum() < 0.95 * err_rtn.sum()
    del g
