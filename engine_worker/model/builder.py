"""Building the served model from a RunnerConfig: weights loaded, then quantized or repacked.

    RunnerConfig --build_model--> BuiltModel (model, quantization report, measured paths,
                                              the matmul plan every layer was built from)

The plan (model/matmul_plan.py) is made first, from the flags, the file's types, the host's
measured choice and the kernels that load here; the layers, the norms and the decode stack are
then built from it, and nothing changes them after.

Two ways in:
  - gguf_path set: the GGUF file's own blocks, float32 activations. Q4_0/Q4_1/Q8_0 files:
    packed, a copy of each layer from `dense_min_rows` rows, the integer-dot kernel at few rows;
    with dense_min_rows AUTO on a CPU, what is faster on this host is measured once and kept in
    the cache dir (engine_worker/path_choice.py). Files with K-quant or Q5 tensors: the
    integer-dot kernel at every row count, each tensor held once (no float copy);
  - a float checkpoint: loaded in the config's dtype, then weight-only INT8/INT4 module swaps
    (engine_worker/model/quant.py). INT4's (tied) LM head is INT8 per group of 32, as the GGUF
    path's Q8_0 head: an INT4 head and a per-channel INT8 head (tried) turn SmolLM2's "The
    capital of France is Paris." into "L'Étoile, ..." (tests/e2e); a float32 head cost 4.5 ms a
    step. From dense_min_rows rows the head reads a bfloat16 copy (54 MiB for SmolLM2, half the
    float32 head it replaces): per-group INT8 at 16 rows halved 16-stream tok/s.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from engine_worker import int_dot
from engine_worker.kernel_build import KernelUnavailable
from engine_worker.model import decode_stack, huge_pages
from engine_worker.model.block_cache import BlockCache
from engine_worker.model.config import ModelConfig
from engine_worker.model.ggml_types import forget_tensors, kernel_format, tensors
from engine_worker.model.gguf_native import check_shapes, legacy_only, load_gguf_model
from engine_worker.model.llama import LlamaForCausalLM
from engine_worker.model.matmul_plan import MatmulPlan
from engine_worker.model.quant import QuantReport, quantize_model, weight_bytes
from engine_worker.model.quant_group import load_group_gemv
from engine_worker.model.requantize import format_of
from engine_worker.model.weights import load_model
from engine_worker.path_choice import PathChoice, choose_paths, native_bf16
from engine_worker.runner_config import AUTO, RunnerConfig

log = logging.getLogger("kestrel.model")

# With dense_min_rows given (not AUTO, which measures: engine_worker/path_choice.py): from this
# many rows GGUF-native layers run a bfloat16 copy through oneDNN. On a CPU with native bfloat16
# the packed INT4 kernel is 2-3x slower at 16 rows, the group-wise INT8 head ~4x; without it the
# copy is 3x slower than the packed path. Costs 2 bytes a weight: ~230 MiB for SmolLM2.
DENSE_ROWS = 4


@dataclass
class BuiltModel:
    model: LlamaForCausalLM
    quant: QuantReport
    paths: PathChoice | None  # what was measured for GGUF-native layers (None: nothing)
    plan: MatmulPlan  # which kernel every matmul runs (model/matmul_plan.py)


def _int_dot_isa(cache_dir: Path) -> str:
    """The integer-dot kernel's instruction path once it is loaded here; "" where it cannot be
    built (then it is no candidate, and torch's packed paths serve)."""
    try:
        int_dot.load(cache_dir)
    except KernelUnavailable as exc:
        log.info("integer-dot kernel unavailable here: %s", exc)
        return ""
    return int_dot.isa()


def build_model(cfg: RunnerConfig, model_cfg: ModelConfig, max_positions: int,
                paged: bool = False) -> BuiltModel:
    """The model `cfg` names on its device, RoPE tables for `max_positions`, every matmul as
    its plan says. `paged`: the paged attention kernel is loaded (the decode stack needs it)."""
    device = torch.device(cfg.device)
    if cfg.gguf_path is not None:  # a file that cannot serve is refused before kernels and timings
        check_shapes(tensors(cfg.gguf_path), model_cfg)
    # Q8_0 (group-wise INT8) layers at few rows: our C++ kernel where it builds (CPU)
    native_q8 = device.type == "cpu" and load_group_gemv(cfg.cache_dir) is None
    if cfg.gguf_path is not None:
        plan, paths = gguf_plan(cfg, model_cfg, native_q8, paged)
        model = load_gguf_model(cfg.gguf_path, model_cfg, device, plan=plan,
                                max_positions=max_positions, requantize=cfg.requantize,
                                blocks=BlockCache.beside(cfg.gguf_path, Path(cfg.model_path)))
        forget_tensors()  # the file's map: nothing reads it after the load
        if device.type == "cpu" and cfg.huge_pages == "auto":  # out of 4 KiB file pages
            huge_pages.adopt(model)
        size = weight_bytes(model)
        return BuiltModel(model, QuantReport("gguf", size, size), paths, plan)
    plan = float_plan(cfg, native_q8)
    model = load_model(cfg.model_path, getattr(torch, cfg.dtype), device,
                       max_positions=max_positions)
    quant = quantize_model(model, cfg.quantization, cfg.group_size, plan=plan)
    return BuiltModel(model, quant, None, plan)


def gguf_plan(cfg: RunnerConfig, model_cfg: ModelConfig, native_q8: bool, paged: bool
              ) -> tuple[MatmulPlan, PathChoice | None]:
    """A GGUF file's plan: its types, the flags, and (dense_min_rows AUTO, CPU) what this host
    measured. Loads the kernels the plan routes to (and the decode stack where it serves)."""
    assert cfg.gguf_path is not None
    on_cpu = cfg.device == "cpu"
    table = tensors(cfg.gguf_path)

    def served(t: Any) -> str:  # a tensor's format as the layers get it
        return format_of(kernel_format(t), cfg.requantize)

    layer_kinds = tuple(sorted({served(t) for name, t in table.items()
                                if name.startswith("blk.") and name.endswith(".weight")
                                and t.shape.size == 2}))
    head = table.get("output.weight", table["token_embd.weight"])
    plan = MatmulPlan(device=cfg.device, use_kernel=on_cpu, native_q8=native_q8,
                      kinds=layer_kinds, head_kind=served(head))
    paths = None
    # K-quant and Q5 files: the integer-dot kernel serves every matmul at every row count
    # (torch has no packed kernel for them; a float copy would be 4-7x the file's size); a
    # re-quantized draft too (the path choice would time the file's types, not the served)
    legacy = legacy_only(cfg.gguf_path) and cfg.requantize == "none"
    if on_cpu and not legacy and _int_dot_isa(cfg.cache_dir):
        plan = replace(plan, int_dot_all=True, origin="the file's types" if cfg.requantize
                       == "none" else f"the file's types, re-quantized to {cfg.requantize}")
    elif cfg.dense_min_rows == AUTO and on_cpu:  # measured on this host
        paths = choose_paths(cfg.gguf_path, cfg.cache_dir, num_layers=model_cfg.num_layers,
                             native_q8=native_q8, int_dot_isa=_int_dot_isa(cfg.cache_dir))
        plan = replace(plan, packed_dtype=paths.compute_dtype,
                       dense_min_rows=paths.dense_min_rows,
                       dense_dtype=paths.dense_dtype or "bfloat16",
                       int_dot_rows=paths.int_dot_rows, int_dot_all=paths.int_dot_everywhere,
                       origin="cached" if paths.confirmed else "measured")
    else:
        rows = DENSE_ROWS if cfg.dense_min_rows == AUTO else cfg.dense_min_rows
        plan = replace(plan, dense_min_rows=rows)
    # A float32 copy of the head (113 MB for SmolLM2) would serve only batches of many
    # sequences (the head sees one row a sequence); a bfloat16 copy earns its keep there.
    plan = replace(plan, head_dense_rows=plan.dense_min_rows
                   if plan.dense_dtype == "bfloat16" else 0)
    stack = (cfg.decode_stack == "auto" and paged and on_cpu and cfg.dtype == "float32"
             and all(plan.routes(k)[0].path == "int_dot" for k in plan.kinds))
    return replace(plan, decode_stack=stack and decode_stack.loads(cfg.cache_dir)), paths


def float_plan(cfg: RunnerConfig, native_q8: bool) -> MatmulPlan:
    """A float checkpoint's plan: its layers float, or swapped for INT8/INT4 (model/quant.py)
    with INT4's head INT8 per group of 32 (a bfloat16 copy from DENSE_ROWS rows where the CPU
    computes bfloat16 natively)."""
    on_cpu = cfg.device == "cpu"
    head_rows = cfg.dense_min_rows
    if head_rows == AUTO:  # the INT4 mode's head copy is bfloat16: only if native
        head_rows = DENSE_ROWS if native_bf16() or not on_cpu else 0
    kind = {"none": "float", "int8": "int8", "int4": "int4"}[cfg.quantization]
    head = {"none": "float", "int8": "int8", "int4": "int8_groups"}[cfg.quantization]
    return MatmulPlan(device=cfg.device, use_kernel=on_cpu, native_q8=native_q8,
                      packed_dtype="bfloat16" if on_cpu else cfg.dtype,
                      head_dense_rows=head_rows, kinds=(kind,), head_kind=head)
