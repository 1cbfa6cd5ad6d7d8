"""Which compute path GGUF-native layers take on this host, chosen by measuring, not assumed.

    RunnerConfig(gguf_path=..., dense_min_rows=AUTO) -> build_model (model/builder.py)
      -> choose_paths(gguf, cfg, cache_dir)
           key = CPU flags, torch version, ISA caps, threads, layer shapes
           <cache_dir>/paths/<key>.json exists and confirmed? -> that choice (milliseconds)
           else: one layer's real blocks, each candidate this CPU has the instructions for,
                 timed at the row counts serving uses (decode batches 1..32, a prefill chunk)
                 -> the fastest per row count -> written there, logged; confirmed once a
                 later start's measurement chose the same paths (a choice measured at one
                 busy start is checked again at the next, until two agree)
      -> the matmul plan's row bounds and dtypes (model/matmul_plan.py), which every layer is
         built from

The candidates:
  - our integer-dot kernel over the file's own blocks (engine_worker/int_dot.py), where it is
    built for this host; chosen up to the largest row count at which it and every smaller one
    were measured faster than every other candidate, and at every row count where it won at
    all those measured (then a step's rows never change path: a mixed step is one pass over
    the weights, model_runner.py). It was timed up to 16 rows only until this kernel's
    prefetch: on the Zen 5 under the AVX2 caps it now beats the float32 copy at 128 rows
    (SmolLM2's layers 1.2-1.9x), where the plan had kept the copy from 32 rows;
  - packed kernels (torch's INT4 kernel, our Q8_0 kernel or torch's INT8 one) with their
    activations in bfloat16 or float32 (torch's INT4 kernel in float32 measured 20x slower
    than in bfloat16 on two CPUs without native bfloat16: which wins is not obvious);
  - a float32 copy of each layer through oneDNN from some row count up (4 bytes a weight: a
    prefill chunk of 128 rows ran 2x (AVX512) to 6x (AVX2) faster than the packed kernel),
    only while all layers' copy fits COPY_BUDGET_BYTES;
  - a bfloat16 copy (2 bytes a weight, the same budget), only where the CPU computes it natively
    (AVX512-BF16 or AMX): elsewhere oneDNN converts every element to float32 and back, 1.8x
    slower than the packed path at 16 rows on an AVX2 host.
The choice is the same for every row of a batch at a given batch size; it changes only with the
number of rows.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from engine_worker.kernel_build import _cpu_flags, sources_digest
from engine_worker.model.matmul_plan import MatmulPlan

log = logging.getLogger("kestrel.paths")

# The most memory a copy of the layers may take (all layers; a float32 copy leaves the head
# packed): SmolLM2's float32 copy is 0.36 GB; a 1.5B model's would be 6 GB, where the packed path
# must do.
COPY_BUDGET_BYTES = 512 << 20
DECODE_ROWS = (1, 2, 4, 8, 16, 32)
PREFILL_ROWS = (64, 128)
CAP_VARS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "KESTREL_CPU_ISA")
INT_DOT = "int_dot"  # the integer-dot candidate's name


@dataclass(frozen=True)
class PathChoice:
    compute_dtype: str  # packed kernels' activations: "float32" or "bfloat16"
    dense_dtype: str  # the copy many rows compute with: "bfloat16", "float32" or "" (none)
    dense_min_rows: int  # from this many rows up; 0: no copy
    native_bf16: bool  # whether a bfloat16 copy was a candidate at all
    timings_ms: dict[str, dict[str, float]]  # candidate -> rows -> ms for one layer's matmuls
    int_dot_rows: int = 0  # up to this many rows the integer-dot kernel; 0: never
    confirmed: bool = False  # two measurements in a row chose these paths

    @property
    def int_dot_everywhere(self) -> bool:
        """The integer-dot kernel won at every row count measured: it serves them all."""
        measured = [int(r) for t in self.timings_ms.values() for r in t]
        return bool(measured) and self.int_dot_rows >= max(measured)

    def same_paths(self, other: PathChoice) -> bool:
        return (self.compute_dtype, self.dense_dtype, self.dense_min_rows, self.int_dot_rows) \
            == (other.compute_dtype, other.dense_dtype, other.dense_min_rows, other.int_dot_rows)

    def describe(self) -> str:
        dense = f"a {self.dense_dtype} copy from {self.dense_min_rows} rows" \
            if self.dense_min_rows else "no copy"
        why = "" if self.native_bf16 else " (no native bfloat16 here)"
        dot = "integer-dot kernel at every row count, " if self.int_dot_everywhere else \
            f"integer-dot kernel up to {self.int_dot_rows} rows, " if self.int_dot_rows else ""
        return f"{dot}packed kernels in {self.compute_dtype}, {dense}{why}"


def native_bf16(flags: str | None = None) -> bool:
    """Whether this CPU computes bfloat16 natively and nothing caps it below that."""
    have = set((flags if flags is not None else _cpu_flags()).split())
    if not have & {"avx512_bf16", "amx_bf16"}:
        return False
    capped = {os.environ.get("ATEN_CPU_CAPABILITY", "").lower(),
              os.environ.get("ONEDNN_MAX_CPU_ISA", "").lower(),
              os.environ.get("KESTREL_CPU_ISA", "").lower()}
    return not capped & {"avx2", "avx", "sse4", "default", "avx512", "avx512_core",
                         "avx512_core_vnni"}


def _key(shapes: list[Any]) -> str:
    h = hashlib.sha256(_cpu_flags().encode())
    h.update(torch.__version__.encode())
    h.update(str(torch.get_num_threads()).encode())
    for var in CAP_VARS:
        h.update(f"{var}={os.environ.get(var, '')}".encode())
    h.update(json.dumps(shapes).encode())
    h.update(sources_digest().encode())  # an edited kernel is measured again
    return h.hexdigest()[:16]


def _time_ms(fn: Any, budget_s: float = 0.05, max_reps: int = 20) -> float:
    """Best milliseconds of `fn()` after a warm-up, repeated within about `budget_s`: the best,
    not the median, so that a neighbour busy for a moment of the measurement does not decide
    (and, cached, keep deciding) which path this host takes."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < 5 or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return min(times)


def measure(layers: dict[str, list[torch.nn.Module]], rows: tuple[int, ...],
            give_up: float = 8.0) -> dict[str, dict[str, float]]:
    """ms per candidate per row count, summed over one transformer layer's matmuls.
    `layers`: candidate name -> the layer's modules built for it (the same weights). A
    candidate `give_up` times slower than the best at some row count is not timed further."""
    out: dict[str, dict[str, float]] = {name: {} for name in layers}

    def hopeless(name: str, r: str) -> bool:
        best = min(t[r] for t in out.values() if r in t)
        return r not in out[name] or out[name][r] > give_up * max(best, 1e-3)

    with torch.inference_mode():
        for i, m in enumerate(rows):
            for name, mods in layers.items():
                if i and hopeless(name, str(rows[0])) and hopeless(name, str(rows[i - 1])):
                    continue  # a reference path, not a contender (twice over: not noise)
                xs = [torch.randn(m, mod.in_features) for mod in mods]
                out[name][str(m)] = round(sum(
                    _time_ms(lambda mod=mod, x=x: mod(x)) for mod, x in zip(mods, xs, strict=True)
                ), 4)
    return out


def decide(timings: dict[str, dict[str, float]], bf16: bool) -> PathChoice:
    """The packed dtype fastest over the decode rows; then the copy (if any) that beats it from
    some row count up to the largest measured, the earliest such, the faster one at the most
    rows between two that qualify."""
    packed = {n.removeprefix("packed-"): t for n, t in timings.items() if n.startswith("packed-")}
    # the one timed at the most rows (a hopeless one stopped early), then the least time there
    dtype = min(packed, key=lambda n: (-len(packed[n]), sum(packed[n].values())))
    base = packed[dtype]
    best: tuple[float, str, int] | None = None  # (ms at the most rows, dtype, from rows)
    for name, t in timings.items():
        if not name.startswith("dense-") or set(t) != set(base):
            continue
        counts = sorted(int(r) for r in t)
        start = next((r for i, r in enumerate(counts)
                      if all(t[str(q)] < base[str(q)] for q in counts[i:])), 0)
        if start and (best is None or t[str(counts[-1])] < best[0]):
            best = (t[str(counts[-1])], name.removeprefix("dense-"), start)
    dot = _int_dot_rows(timings)
    if best is None:
        return PathChoice(dtype, "", 0, bf16, timings, dot)
    return PathChoice(dtype, best[1], best[2], bf16, timings, dot)


def _int_dot_rows(timings: dict[str, dict[str, float]]) -> int:
    """The largest row count up to which the integer-dot candidate was measured faster than
    every other candidate at every row count; 0 if not even at one row."""
    dot = timings.get(INT_DOT, {})
    rows = 0
    for r in sorted(int(q) for q in dot):
        others = [t[str(r)] for n, t in timings.items() if n != INT_DOT and str(r) in t]
        if not others or dot[str(r)] >= min(others):
            break
        rows = r
    return rows


def choose_paths(gguf_path: Path, cache_dir: Path, *, num_layers: int, device: str = "cpu",
                 native_q8: bool = False, copy_budget: int = COPY_BUDGET_BYTES,
                 int_dot_isa: str = "") -> PathChoice:
    """The choice for this host and model, from the cache dir or measured now (a few s).
    A copy whose `num_layers` layers would take more than `copy_budget` bytes is no candidate;
    `int_dot_isa`: the integer-dot kernel is loaded, built for that path ("": not a candidate)."""
    from engine_worker.model.gguf_native import layer_blocks
    from engine_worker.model.linear_factory import from_blocks

    blocks = layer_blocks(gguf_path, 0)
    shapes = [(b.kind, b.n, b.k) for b in blocks]
    weights = num_layers * sum(b.n * b.k for b in blocks)
    key = _key([*shapes, num_layers, copy_budget, native_q8, int_dot_isa])
    path = Path(cache_dir) / "paths" / f"{key}.json"
    bf16 = native_bf16()
    saved: PathChoice | None = None
    try:
        saved = PathChoice(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        pass
    if saved is not None and saved.confirmed:
        log.info("compute paths for this host (cached in %s): %s", path, saved.describe())
        return saved
    t0 = time.monotonic()
    dev = torch.device(device)
    # each candidate is a plan of its own, with one path at every row count it is timed at
    base = MatmulPlan(device=device, native_q8=native_q8)
    candidates = {"packed-bfloat16": base, "packed-float32": replace(base, packed_dtype="float32")}
    if 4 * weights <= copy_budget:
        candidates["dense-float32"] = replace(base, dense_min_rows=1, dense_dtype="float32")
    if bf16 and 2 * weights <= copy_budget:  # elsewhere every element is converted to float32
        candidates["dense-bfloat16"] = replace(base, dense_min_rows=1)  # and back: no contender
    if int_dot_isa and all(b.fmt != "float" for b in blocks):
        candidates[INT_DOT] = replace(base, int_dot_all=True)
    layers = {name: [from_blocks(b, plan, dev) for b in blocks]
              for name, plan in candidates.items()}
    choice = decide(measure(layers, (*DECODE_ROWS, *PREFILL_ROWS)), bf16)
    if saved is not None:  # the earlier start's choice, checked again by this measurement
        choice = replace(choice, confirmed=choice.same_paths(saved))
    log.info("compute paths for this host, measured in %.1f s: %s (%s); ms per layer by rows: "
             "%s", time.monotonic() - t0, choice.describe(),
             "the first measurement" if saved is None else
             "as the last start's: kept" if choice.confirmed else
             f"the last start's differed ({saved.describe()}): measured again at the next",
             json.dumps(choice.timings_ms))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(choice), indent=1))
        tmp.replace(path)  # atomic: a concurrent start reads a whole file or none
    except OSError as e:
        log.warning("could not keep the compute path choice in %s: %s", path, e)
    return choice
