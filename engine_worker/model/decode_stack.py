"""Decode rows through the whole decoder in one C++ call (issue 21): csrc/decode_stack.cpp.

    the matmul plan (model/matmul_plan.py) says whether it serves: every layer's linears on
    the integer-dot kernel at one row, float32 on CPU, paged attention, and the kernels load
    build(model, plan) once, after the load
      -> a DecodeStack holding each layer's packed weights and norms (the model's norms were
         built with the stack's RMSNorm); None where the plan has none
    model.forward, a step with decode rows on CPU (model/llama.py)
      -> rows [0, B) (one-token decodes, and verification tokens run as decodes)
         -> DecodeStack(x, cos, sin, kv_cache, meta) -> (B, C), every layer in C++
      -> the prefill rows, if any, through the Python layers on their own

Why: at batch 1 the Python-level torch calls around the matmuls (RMSNorm's pieces, RoPE's
chunk/cat/mul, index_copy, views, residual adds; ~25 per layer) took longer than the matmuls on
the Ice Lake. The C++ stack runs the same ops in the same order (its RMSNorm, which the model's
Python norms then call too, for every row), so a row is bit for bit what the Python layers give
it when they take the integer-dot kernel; and a decode row's result no
longer depends on the step around it: the rows of a prefill chunk sharing its step, which
once moved every row to another kernel from some row count up, run apart.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from engine_worker import int_dot
from engine_worker.kernel_build import KernelUnavailable, load_kernel
from engine_worker.kv_cache import KVCache
from engine_worker.model.attention import AttnMeta
from engine_worker.model.gguf_native import Parts
from engine_worker.model.int_dot_linear import IntDotLinear
from engine_worker.model.layers import RMSNorm
from engine_worker.model.matmul_plan import MatmulPlan

log = logging.getLogger("kestrel.model")


class DecodeStack:
    """The C++ stack of one model, and the call that feeds it one step's decode rows."""

    def __init__(self, stack: torch.ScriptObject) -> None:
        self.stack = stack

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVCache,
                 meta: AttnMeta) -> torch.Tensor:
        """x (B, C) float32 decode rows; cos, sin (B, 1, D) at their positions -> (B, C)."""
        b = x.shape[0]
        assert meta.slot_mapping is not None and meta.decode_table is not None \
            and meta.decode_lens is not None
        return self.stack.forward(x.contiguous(), cos.reshape(b, -1), sin.reshape(b, -1),
                                  kv.k, kv.v, meta.slot_mapping[:b], meta.decode_table,
                                  meta.decode_lens, meta.block_size)


def why_not(model: torch.nn.Module) -> str | None:
    """Why this model's decode rows cannot run in the stack (None: they can)."""
    for i, layer in enumerate(model.model.layers):
        if not all(_parts(m) for m in _linears(layer)):
            return f"layer {i} has linears the integer-dot kernel does not serve"
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if not isinstance(norm, RMSNorm) or norm.weight.dtype != torch.float32 \
                    or norm.weight.device.type != "cpu":
                return f"layer {i}'s norms are not float32 RMSNorms on the CPU"
    return None


def _linears(layer: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
    return (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
            layer.mlp.down_proj)


def _parts(lin: torch.nn.Module) -> list[IntDotLinear]:
    """The integer-dot matrices a linear is made of, in output order; [] if any is not one."""
    parts = list(lin.parts) if isinstance(lin, Parts) else [lin]
    return parts if all(isinstance(p, IntDotLinear) for p in parts) else []


def load(cache_dir: str | Path) -> None:
    """Build (first time on this host) and load the library; KernelUnavailable says why not."""
    load_kernel("decode_stack", str(cache_dir), "decode_stack_loaded", seconds=30)


def loads(cache_dir: str | Path) -> bool:
    """Whether the stack and the integer-dot kernel it calls load here (the matmul plan asks,
    before the model is built: its norms take the stack's numerics where it serves)."""
    try:
        int_dot.load(cache_dir)
        load(cache_dir)
    except KernelUnavailable as exc:
        log.info("decode rows run layer by layer in Python: %s", exc)
        return False
    return True


def build(model: torch.nn.Module, plan: MatmulPlan) -> DecodeStack | None:
    """The model's decode stack where its plan has one (None: the Python layers serve every
    row). The plan's maker has loaded the kernels, the paged attention's included."""
    if not plan.decode_stack:
        return None
    reason = why_not(model)
    if reason is not None:  # the plan said every layer is integer-dot: a bug if not
        raise RuntimeError(f"the matmul plan runs decode rows through the stack, but {reason}")
    cfg = model.config
    stack = torch.classes.kestrel.DecodeStack(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                              float(cfg.rms_norm_eps))
    for layer in model.model.layers:
        for lin in _linears(layer):
            for part in _parts(lin):
                p = part.packed
                bias = None if part.bias is None else part.bias.to(torch.float32)
                stack.add_part(p.fmt, p.qs, p.d, p.m, p.n, p.k, bias)
            stack.end_linear()
        stack.add_layer(layer.input_layernorm.weight.detach(),
                        layer.post_attention_layernorm.weight.detach())
    log.info("decode rows run through the C++ decode stack (%d layers)", stack.num_layers())
    return DecodeStack(stack)
