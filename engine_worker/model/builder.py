"""Building the served model from a RunnerConfig: weights loaded, then quantized or repacked.

    RunnerConfig --build_model--> BuiltModel (model, quantization report, measured paths,
                                              the row count from which layers switch kernels)

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
from dataclasses import dataclass
from pathlib import Path

import torch

from engine_worker import int_dot
from engine_worker.kernel_build import KernelUnavailable
from engine_worker.model.block_cache import BlockCache
from engine_worker.model.config import ModelConfig
from engine_worker.model.ggml_types import forget_tensors, tensors
from engine_worker.model.gguf_native import check_shapes, legacy_only, load_gguf_model
from engine_worker.model.llama import LlamaForCausalLM
from engine_worker.model.quant import QuantReport, quantize_model, weight_bytes
from engine_worker.model.quant_group import load_group_gemv
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
    kernel_rows: int  # rows from which GGUF layers switch kernels (0: none): a compiled bucket edge


def _int_dot_isa(cache_dir: Path) -> str:
    """The integer-dot kernel's instruction path once it is loaded here; "" where it cannot be
    built (then it is no candidate, and torch's packed paths serve)."""
    try:
        int_dot.load(cache_dir)
    except KernelUnavailable as exc:
        log.info("integer-dot kernel unavailable here: %s", exc)
        return ""
    return int_dot.isa()


def build_model(cfg: RunnerConfig, model_cfg: ModelConfig, max_positions: int) -> BuiltModel:
    """The model `cfg` names on its device, RoPE tables for `max_positions`."""
    device = torch.device(cfg.device)
    dense_min_rows = cfg.dense_min_rows
    if cfg.gguf_path is not None:  # a file that cannot serve is refused before kernels and timings
        check_shapes(tensors(cfg.gguf_path), model_cfg)
    # Q8_0 (group-wise INT8) layers at few rows: our C++ kernel where it builds (CPU)
    native_q8 = device.type == "cpu" and load_group_gemv(cfg.cache_dir) is None
    if cfg.gguf_path is not None:
        paths = None
        compute = dense_dtype = torch.bfloat16
        int_dot_rows = 0
        # K-quant and Q5 files: the integer-dot kernel serves every matmul at every row count
        # (torch has no packed kernel for them; a float copy would be 4-7x the file's size)
        int_dot_all = (device.type == "cpu" and not legacy_only(cfg.gguf_path)
                       and bool(_int_dot_isa(cfg.cache_dir)))
        if int_dot_all:
            dense_min_rows = 0
        elif dense_min_rows == AUTO and device.type == "cpu":  # measured on this host
            paths = choose_paths(cfg.gguf_path, cfg.cache_dir, num_layers=model_cfg.num_layers,
                                 native_q8=native_q8, int_dot_isa=_int_dot_isa(cfg.cache_dir))
            compute = getattr(torch, paths.compute_dtype)
            dense_min_rows = paths.dense_min_rows
            dense_dtype = getattr(torch, paths.dense_dtype or "bfloat16")
            int_dot_rows = paths.int_dot_rows
        dense_min_rows = DENSE_ROWS if dense_min_rows == AUTO else dense_min_rows
        model = load_gguf_model(cfg.gguf_path, model_cfg, device, compute_dtype=compute,
                                max_positions=max_positions, dense_dtype=dense_dtype,
                                dense_min_rows=dense_min_rows, native_q8=native_q8,
                                int_dot_rows=int_dot_rows, int_dot_all=int_dot_all,
                                blocks=BlockCache.beside(cfg.gguf_path, Path(cfg.model_path)))
        forget_tensors()  # the file's map: nothing reads it after the load
        size = weight_bytes(model)
        return BuiltModel(model, QuantReport("gguf", size, size), paths, dense_min_rows)
    if dense_min_rows == AUTO:  # the INT4 mode's head copy is bfloat16: only if native
        dense_min_rows = DENSE_ROWS if native_bf16() or device.type != "cpu" else 0
    model = load_model(cfg.model_path, getattr(torch, cfg.dtype), device,
                       max_positions=max_positions)
    quant = quantize_model(model, cfg.quantization, cfg.group_size, native_q8=native_q8,
                           head_dense_rows=dense_min_rows)
    return BuiltModel(model, quant, None, 0)
