"""One factory for every linear layer: its weights and the plan's routes -> the layer.

    a GGUF tensor's blocks ──from_blocks──▶ routes = plan.routes(its format)
        the integer-dot kernel first? IntDotLinear(the blocks packed for it, the layer behind)
        the layer behind (or the only one) ──▶ Codes, the blocks' own codes, none rounded
    a float checkpoint's matrix ──from_float──▶ routes = plan.routes(the mode's kind)
        ──▶ Codes by the kind's rounding rule (ROUNDING)
    Codes ──layer──▶ LAYERS[kind](codes, routes, bias): one row a kind

Both paths end in the same table, so a kind's layer is built one way whichever file it came
from (a Q8_0 tensor and the same floats rounded by the int8_groups rule give the same layer,
tests/engine_worker/model/test_linear_factory.py). A GGUF format is one integer-dot kernel and one
row of int_dot.FORMAT_TABLE (the codes it maps to, the kind behind it); a layer kind is one row
here and the methods of its RoutedLinear class.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from engine_worker import int_dot
from engine_worker.model.ggml_types import Blocks
from engine_worker.model.int4 import Int4GroupLinear, int4_groups
from engine_worker.model.int8 import Int8Linear, per_row
from engine_worker.model.int_dot_linear import IntDotLinear
from engine_worker.model.layers import Linear
from engine_worker.model.matmul_plan import MatmulPlan, Route, routes_dtype
from engine_worker.model.quant_group import Int8GroupLinear, q8_groups


@dataclass
class Codes:
    """A matrix (N, K) as a layer kind holds it."""

    kind: str  # "float", "int8" (per row), "int8_groups" (per 32), "int4" (per group)
    q: torch.Tensor  # the codes (int8, or int4's 0..15), or the float matrix itself
    scale: torch.Tensor | None = None  # (N,) per row, or (N, K/G) per group
    zero: torch.Tensor | None = None  # int4: w = (q - 8) * scale + zero
    group: int = 0
    weight: torch.Tensor | None = None  # the float matrix where the caller has it (a copy's)


def _float(c: Codes, routes: tuple[Route, ...], bias: torch.Tensor | None) -> nn.Module:
    lin = Linear(c.q.shape[1], c.q.shape[0], bias=bias is not None, device="meta")
    lin.weight = nn.Parameter(c.q, requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.to(c.q.dtype), requires_grad=False)
    return lin


def _int4(c: Codes, routes: tuple[Route, ...], bias: torch.Tensor | None) -> nn.Module:
    assert c.scale is not None and c.zero is not None
    cd = routes_dtype(routes) or c.scale.dtype  # the scales' and zeros' dtype
    return Int4GroupLinear.from_codes(c.q.to(torch.int32), c.scale.to(cd), c.zero.to(cd),
                                      c.group, bias, routes=routes, weight=c.weight)


# kind -> its layer, from codes, routes and bias (the one place a layer class is chosen)
LAYERS: dict[str, Callable[[Codes, tuple[Route, ...], torch.Tensor | None], nn.Module]] = {
    "float": _float,
    "int8": lambda c, routes, bias: Int8Linear(c.q, c.scale, bias, routes),
    "int8_groups": lambda c, routes, bias: Int8GroupLinear(c.q, c.scale, routes, bias),
    "int4": _int4,
}


def layer(codes: Codes, routes: tuple[Route, ...], bias: torch.Tensor | None = None
          ) -> nn.Module:
    """The layer of codes.kind over `codes`, taking `routes`."""
    return LAYERS[codes.kind](codes, routes, bias)


# -- the float checkpoint's path -----------------------------------------------------------------

def _round_int8(w: torch.Tensor, routes: tuple[Route, ...], group: int, clip: bool) -> Codes:
    q, scales = per_row(w, routes_dtype(routes) or w.dtype)
    return Codes("int8", q, scales)


def _round_int8_groups(w: torch.Tensor, routes: tuple[Route, ...], group: int,
                       clip: bool) -> Codes:
    q, scales = q8_groups(w)
    return Codes("int8_groups", q, scales, group=32)


def _round_int4(w: torch.Tensor, routes: tuple[Route, ...], group: int, clip: bool) -> Codes:
    q, scale, zero = int4_groups(w, group, routes_dtype(routes) or w.dtype, clip)
    return Codes("int4", q, scale, zero, group)


# kind -> its rounding rule over a float (N, K) matrix
ROUNDING: dict[str, Callable[[torch.Tensor, tuple[Route, ...], int, bool], Codes]] = {
    "int8": _round_int8,
    "int8_groups": _round_int8_groups,
    "int4": _round_int4,
}


def from_float(w: torch.Tensor, bias: torch.Tensor | None, kind: str,
               routes: tuple[Route, ...], *, group: int = 32,
               clip_search: bool = False) -> nn.Module:
    """A float checkpoint's (N, K) matrix rounded by `kind`'s rule, as the layer of that kind."""
    codes = ROUNDING[kind](w.detach(), routes, group, clip_search)
    return layer(codes, routes, None if bias is None else bias.detach().clone())


# -- the GGUF path -------------------------------------------------------------------------------

Packer = Callable[[Blocks], int_dot.Packed]


def block_codes(b: Blocks, device: torch.device, routes: tuple[Route, ...]) -> Codes:
    """A GGUF tensor's blocks as the codes of the layer torch's kernels take (its format's table
    row says which and how), none rounded; formats with no such form as their float matrix."""
    b = b.packable()
    if b.kind == "float":  # (formats torch has no packed kernel for, where ours is not built)
        return Codes("float", torch.from_numpy(b.floats()).to(device))
    q, scale, zero = b.codes_scales()
    codes = torch.from_numpy(np.ascontiguousarray(q)).to(device)
    s = torch.from_numpy(scale).to(device)
    if b.kind == "int4":
        z = torch.from_numpy(zero).to(device)  # type: ignore[arg-type]
        copy = any(r.path == "dense" for r in routes)  # the floats, not the tiled bytes read back
        return Codes("int4", codes, s, z, 32,
                     torch.from_numpy(b.floats()).to(device) if copy else None)
    return Codes("int8_groups", codes, s, group=32)


def from_blocks(b: Blocks, plan: MatmulPlan, device: torch.device, head: bool = False,
                bias: torch.Tensor | None = None, pack: Packer | None = None) -> nn.Module:
    """A GGUF tensor's layer by the plan's routes for its format: the integer-dot kernel (loaded
    by the caller) alone, or in front of the layer of its codes that takes the rows past its
    bound, or that layer alone. `pack`: the blocks in the kernel's layout (the block cache's
    mapped copy; default: packed here)."""
    routes = plan.routes(b.fmt, head, fits=b.n % 16 == 0)
    pack = pack or (lambda b: int_dot.pack(b.fmt, b.raw, b.n, b.k))
    if routes[0].path == "int_dot":  # the kernel in front adds the bias, whoever computes
        behind = routes[1:]
        fallback = layer(block_codes(b, device, behind), behind) if behind else None
        return IntDotLinear(pack(b), fallback, routes[0].upto, bias)
    return layer(block_codes(b, device, routes), routes,
                 None if bias is None else bias.to(device))
