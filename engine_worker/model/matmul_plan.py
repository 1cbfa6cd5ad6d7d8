"""The matmul plan: which kernel each linear layer runs, by weight kind and row count, chosen once.

    the flags (RunnerConfig) + the file's weight kinds + the host's measured choice
    (engine_worker/path_choice.py) + which of our kernels load here
      -> MatmulPlan (frozen), made once by the builder (engine_worker/model/builder.py)
      -> every linear layer is built from `plan.routes(kind)`: a table "up to N rows -> path",
         which its forward looks up (no chain of branches): one module, RoutedLinear
         (model/routed_linear.py), each format's layer its weights and a method per path
      -> the RMSNorms, the C++ decode stack and the thread choice read `decode_stack`, the
         compiled decode its bucket edges from `switch_rows`; nothing changes a module after
      -> logged once at start as one line `matmul plan: ...`, sent in the worker's hello and
         shown by the gateway's /health

Paths, by name (what a route runs):
  int_dot     our integer-dot kernel over the file's own blocks (engine_worker/int_dot.py)
  int4        torch's packed INT4 kernel, activations in `packed_dtype`
  q8          our C++ Q8_0 kernel, 8 rows a call (csrc/group_gemv.cpp)
  int8_groups torch's per-channel INT8 kernel once per group of 32 inputs
  int8        torch's per-channel INT8 kernel (a float checkpoint's INT8 mode)
  dense       a copy of the weights in `dense_dtype` (the head's: bfloat16) through oneDNN
  dequantize  the weights dequantized for the call, then one matmul (the exact mode; a prefill
              chunk of a Q8_0 layer that keeps no copy)
  float       float weights through oneDNN (model/layers.py)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine_worker import int_dot

ALL = 1 << 62  # a route's bound: every row count above the previous route's


def torch_kind(fmt: str) -> str:
    """How a GGUF block format reaches torch's packed kernels (its table row's torch_kind; Q5_0
    as Q8_0 codes: Blocks.packable); "float" for the others (the integer-dot kernel serves
    them, or a float copy where it cannot)."""
    f = int_dot.FORMAT_TABLE.get(fmt)
    return f.torch_kind if f is not None and f.torch_kind else "float"

NATIVE_CHUNKED_ROWS = 32  # q8 without a copy: up to this many rows, 8 at a time; then dequantize


@dataclass(frozen=True)
class Route:
    upto: int  # the most rows this path takes
    path: str
    dtype: str = ""  # the activations' (packed kernels, dequantize) or the copy's dtype

    def label(self, low: int) -> str:
        rows = f"{low}+" if self.upto >= ALL else f"{low}" if self.upto == low \
            else f"{low}-{self.upto}"
        return f"{self.path}{f'({self.dtype})' if self.dtype else ''} {rows}"


def pick(routes: tuple[tuple[int, Any], ...], rows: int) -> Any:
    """The entry of a layer's table for `rows` rows: the first whose bound holds them."""
    for upto, entry in routes:
        if rows <= upto:
            return entry
    return routes[-1][1]


def routes_dtype(routes: tuple[Route, ...]) -> torch.dtype | None:
    """The torch dtype a quantized layer keeps its scales in: that of its first route naming
    one other than a float copy's (None: the weights' own)."""
    name = next((r.dtype for r in routes if r.dtype and r.path != "dense"), "")
    return getattr(torch, name) if name else None


def _nonempty(routes: tuple[Route, ...]) -> tuple[Route, ...]:
    """Without the routes an earlier one covers whole (a copy from 16 rows behind the
    integer-dot kernel up to 16: the packed kernel between them takes no row count)."""
    out: list[Route] = []
    for r in routes:
        if r.upto >= (out[-1].upto + 1 if out else 1):
            out.append(r)
    return tuple(out)


def describe_routes(routes: tuple[Route, ...]) -> str:
    """"q8 1-32, dense(bfloat16) 33+": the path per row range."""
    low, parts = 1, []
    for r in routes:
        parts.append(r.label(low))
        low = r.upto + 1
    return ", ".join(parts)


@dataclass(frozen=True)
class MatmulPlan:
    """What every linear of one model runs on this host; `routes(kind)` is the whole rule."""

    device: str = "cpu"
    packed_dtype: str = "bfloat16"  # torch's packed kernels' activations (and a q8 dequantize)
    use_kernel: bool = True  # False: every quantized layer dequantizes (the tests' exact mode)
    dense_min_rows: int = 0  # layers' copy from this many rows (0: none)
    dense_dtype: str = "bfloat16"
    head_dense_rows: int = 0  # the head's bfloat16 copy from this many rows (0: none)
    native_q8: bool = False  # our Q8_0 kernel loaded here
    int_dot_rows: int = 0  # the integer-dot kernel up to this many rows, packed layers behind
    int_dot_all: bool = False  # the integer-dot kernel at every row count (no packed layer)
    decode_stack: bool = False  # decode rows through the C++ stack (every layer int_dot)
    kinds: tuple[str, ...] = ()  # the decoder layers' weight kinds, for the description
    head_kind: str = ""
    origin: str = "flags"  # where the row bounds came from: flags, measured or cached

    @property
    def on_cpu(self) -> bool:
        return self.device == "cpu"

    def routes(self, kind: str, head: bool = False, *, fits: bool = True) -> tuple[Route, ...]:
        """The table a layer of this weight kind is built with. `kind`: a GGUF block format
        (q4_0, q8_0, q8_1, ...) or a float checkpoint's layer (float, int8, int4, int8_groups);
        `fits`: False for an INT4 layer whose rows torch's kernel cannot tile (not 16k)."""
        gguf = kind in int_dot.FORMAT_TABLE
        if gguf and self.int_dot_all and self.on_cpu:
            return (Route(ALL, "int_dot"),)
        front = (Route(self.int_dot_rows, "int_dot"),) \
            if gguf and self.int_dot_rows and self.on_cpu else ()
        behind = torch_kind(kind) if gguf else kind
        return _nonempty(front + self._packed(behind, head, fits))

    def _packed(self, kind: str, head: bool, fits: bool) -> tuple[Route, ...]:
        pd = self.packed_dtype
        if kind == "float":
            return (Route(ALL, "float"),)
        kernel = self.use_kernel and self.on_cpu and (fits or kind != "int4")
        if not kernel:
            return (Route(ALL, "dequantize"),)
        if kind == "int8":
            return (Route(ALL, "int8", pd),)
        copy = self.head_dense_rows if head else self.dense_min_rows
        copy_dtype = "bfloat16" if head else self.dense_dtype
        tail = (Route(ALL, "dense", copy_dtype),) if copy else ()
        last = copy - 1 if copy else ALL
        if kind == "int4":
            return (Route(last, "int4", pd), *tail)
        if not self.native_q8:  # int8_groups
            return (Route(last, "int8_groups", pd), *tail)
        q8 = (Route(min(last, NATIVE_CHUNKED_ROWS), "q8"),)
        if last > NATIVE_CHUNKED_ROWS:  # a prefill chunk with no copy (or before it starts)
            q8 += (Route(last, "dequantize", pd),)
        return (*q8, *tail)

    def switch_rows(self) -> tuple[int, ...]:
        """Row counts at which some layer of this model changes path: the compiled decode's
        bucket edges (a bucket must not straddle one)."""
        kinds = [(k, False) for k in self.kinds] + ([(self.head_kind, True)]
                                                    if self.head_kind else [])
        edges = {r.upto + 1 for k, head in kinds for r in self.routes(k, head)[:-1]}
        return tuple(sorted(edges))

    def describe(self) -> str:
        """One line: per weight kind, the path per row range."""
        kinds = [f"{k}: {describe_routes(self.routes(k))}" for k in self.kinds]
        if self.head_kind:
            kinds.append(f"head {self.head_kind}: "
                         f"{describe_routes(self.routes(self.head_kind, True))}")
        stack = "; decode rows through the C++ decode stack" if self.decode_stack else ""
        return f"matmul plan: {'; '.join(kinds)}{stack} ({self.origin})"


def default_routes(kind: str, device: str, *, fits: bool = True) -> tuple[Route, ...]:
    """A layer's routes without a plan of its own (a test, a layer made by hand): what the
    default plan gives its kind on `device` (on CPU torch's packed kernel with bfloat16
    activations, else dequantize)."""
    return MatmulPlan(device=device).routes(kind, fits=fits)
