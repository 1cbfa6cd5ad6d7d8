"""Weight-only quantization as module swaps: INT8 per-output-channel and INT4 group-wise packed.

Data flow of `quantize_model(model, "int8" | "int4", group_size)`, run once after loading:

    each nn.Linear of the decoder layers (fused qkv_proj, o_proj, gate_up_proj, down_proj)
      -> linear_factory.from_float: codes by the mode's rounding rule, then the kind's layer
         (the table the GGUF path builds its layers from too) -> setattr on its parent
    LM head (optional): an untied head is swapped the same way; a tied one (SmolLM2) gets its
      own quantized head, and the embedding becomes an Int8Embedding (shared with an INT8 head)
      so the float matrix is freed
    -> QuantReport (weight bytes before and after, group size used per layer)

The layers are in int8.py, int4.py and quant_group.py (group-wise INT8, the GGUF Q8_0 layout).
A quantized layer's forward is `x (M, K) -> (M, N)` like nn.Linear, so llama.py calls it
unchanged. Each is built with the routes the plan gives its kind (model/matmul_plan.py), which
name the path per row count; two paths compute it:
  - kernel: torch's packed weight-only matmuls (`_weight_int8pack_mm`,
    `_weight_int4pack_mm_for_cpu`) on CPU. Their float32 paths measured ~10x slower than a float
    matmul here, their bfloat16 paths 2-7x faster (avx512_bf16), so on CPU activations enter
    them in bfloat16 (the route's dtype) and leave in the caller's dtype.
  - fallback: dequantize to the activations' dtype, then F.linear. Every other device (CUDA
    included, for now), and shapes the kernel refuses (INT4 needs N % 16 == 0).
Tests hold the two against each other. Scales (and zeros) are stored in the route's dtype and
weights are rounded against the stored values, so rounding a scale adds no error of its own.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from engine_worker.config import QUANT_GROUP_SIZES, QUANTIZATIONS, check_choice
from engine_worker.model.int4 import TILED_GROUPS
from engine_worker.model.int8 import Int8Embedding, Int8Linear
from engine_worker.model.linear_factory import from_float
from engine_worker.model.matmul_plan import MatmulPlan
from engine_worker.model.quant_group import GROUP, Int8GroupEmbedding, Int8GroupLinear

log = logging.getLogger("kestrel.quant")


def pick_group_size(in_features: int, requested: int) -> int | None:
    """`requested` if it divides in_features, else the largest smaller allowed size that does."""
    fits = [g for g in QUANT_GROUP_SIZES if g <= requested and in_features % g == 0]
    return max(fits) if fits else None


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights held: parameters and persistent buffers, and the integer-dot
    layers' packed blocks (IntDotLinear.packed: plain tensors, not buffers); shared storage
    once."""
    seen: dict[tuple[int, int], int] = {}  # (address, bytes) -> bytes: a tied tensor once
    tensors = [t for t in model.state_dict(keep_vars=True).values() if t is not None]
    for m in model.modules():
        packed = getattr(m, "packed", None)
        if packed is not None:
            tensors += [t for t in (packed.qs, packed.d, packed.m) if t is not None]
    for t in tensors:
        seen[(t.data_ptr(), t.nbytes)] = t.nbytes
    return sum(seen.values())


def _held(module: nn.Module) -> set[tuple[int, int]]:
    """(address, bytes) of the tensors a module holds itself (not its children's): parameters,
    buffers and an integer-dot layer's packed blocks."""
    skip = module._non_persistent_buffers_set  # RoPE's tables: a row each, not weights
    tensors = [*module.parameters(recurse=False),
               *(b for name, b in module._buffers.items() if name not in skip)]
    packed = getattr(module, "packed", None)
    if packed is not None:
        tensors += [t for t in (packed.qs, packed.d, packed.m) if t is not None]
    routes = getattr(module, "routes", None)
    copy = getattr(module, "dense", None)
    if routes and routes[0].path != "dense" and isinstance(copy, torch.Tensor):
        tensors = [t for t in tensors if t is not copy]  # a copy for more rows than one
    return {(t.data_ptr(), t.nbytes) for t in tensors if t is not None}


def _one_row(model: nn.Module, skip: set[int]) -> set[tuple[int, int]]:
    """The tensors a one-row step reads of the modules not in `skip` (ids): an integer-dot
    layer's own blocks where its kernel takes one row, not the layer behind it."""
    read: set[tuple[int, int]] = set()
    for m in model.modules():
        if id(m) in skip:
            continue
        read |= _held(m)
        if getattr(m, "packed", None) is not None and getattr(m, "max_rows", 0) >= 1:
            skip |= {id(c) for c in m.modules() if c is not m}  # its fallback: more rows
    return read


def decode_read_bytes(model: nn.Module) -> int:
    """Bytes of weights one decode step of one sequence reads (issue 53): every weight a
    one-row matmul takes (an integer-dot layer's blocks, not the copy behind it for more rows),
    and of the embedding table one row; a head that shares the table's storage reads it whole.
    With the KV cache's bytes of the context, what bounds a one-stream step: its floor is
    these bytes over the host's memory bandwidth."""
    embed = model.model.embed_tokens
    inside = {id(m) for m in embed.modules()}
    table = set().union(*(_held(m) for m in embed.modules()))
    rest = _one_row(model, set(inside))
    if getattr(model, "lm_head", True) is None:  # tied: the head is the table itself
        return sum(n for _, n in rest | table)
    vocab = model.config.vocab_size
    row = sum(n for _, n in table - rest) // max(1, vocab)
    return sum(n for _, n in rest) + row


@dataclass
class QuantReport:
    mode: str
    bytes_before: int
    bytes_after: int
    # quantized layer -> INT4 group size used (0 for INT8: one scale per output channel)
    group_sizes: dict[str, int] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)  # layers left in float
    # (in_features, group used) -> layers whose in_features the requested group does not divide
    fallbacks: dict[tuple[int, int], list[str]] = field(default_factory=dict)

    def __str__(self) -> str:
        return (f"{self.mode}: weights {self.bytes_before / 2**20:.1f} MiB -> "
                f"{self.bytes_after / 2**20:.1f} MiB ({len(self.group_sizes)} layers quantized, "
                f"{len(self.skipped)} left in float)")


def _quantize(
    w: torch.Tensor, b: torch.Tensor | None, name: str, mode: str, group_size: int,
    report: QuantReport, plan: MatmulPlan, clip_search: bool,
) -> nn.Module | None:
    if mode == "int8g32" and b is None and w.shape[1] % GROUP == 0:
        report.group_sizes[name] = GROUP
        return from_float(w, None, "int8_groups", plan.routes("int8_groups", head=True))
    if mode in ("int8", "int8g32"):
        report.group_sizes[name] = 0
        return from_float(w, b, "int8", plan.routes("int8"))
    g = pick_group_size(w.shape[1], group_size)
    if g is None:
        log.warning("%s: in_features %d has no group size <= %d; left in float",
                    name, w.shape[1], group_size)
        report.skipped.append(name)
        return None
    if g != group_size:
        report.fallbacks.setdefault((w.shape[1], g), []).append(name)
    report.group_sizes[name] = g
    fits = w.shape[0] % 16 == 0 and g in TILED_GROUPS
    return from_float(w, b, "int4", plan.routes("int4", fits=fits), group=g,
                      clip_search=clip_search)


@torch.no_grad()
def quantize_model(
    model: nn.Module, mode: str, group_size: int = 32, *, lm_head: bool = True,
    head_mode: str | None = None, plan: MatmulPlan | None = None, clip_search: bool = False,
) -> QuantReport:
    """Swap the model's projections for quantized ones in place (after loading; init_rope
    already done), each with the routes `plan` gives its kind (model/matmul_plan.py; default:
    torch's kernels in bfloat16 on CPU, dequantize elsewhere). mode: none | int8 | int4.
    lm_head: quantize the head too (and, if tied, the embedding to INT8), in head_mode
    (default: mode). Returns what changed; logs it."""
    check_choice("quantization", mode, QUANTIZATIONS)
    check_choice("group_size", group_size, QUANT_GROUP_SIZES)
    report = QuantReport(mode, weight_bytes(model), 0)
    if mode == "none":
        report.bytes_after = report.bytes_before
        return report
    if plan is None:
        device = next(model.parameters()).device.type
        plan = MatmulPlan(device=device, use_kernel=device == "cpu")
    # clip_search is off by default: 19 passes over the weights made a loaded 2-core host's INT4
    # worker start exceed 3 minutes.
    targets = [(n, m) for n, m in model.named_modules()
               if isinstance(m, nn.Linear) and (lm_head or n != "lm_head")]
    # INT4 mode's head: group-wise INT8. A per-row INT8 (and an INT4) head turned SmolLM2's
    # "The capital of France is Paris." into "L'Étoile, ..."; a float32 head cost 4.5 ms/step.
    head_mode = head_mode or ("int8g32" if mode == "int4" else mode)
    for name, mod in targets:
        m = head_mode if name == "lm_head" else mode
        new = _quantize(mod.weight, mod.bias, name, m, group_size, report, plan, clip_search)
        if new is not None:
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name), attr, new)
    inner = getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None)
    if lm_head and getattr(model, "lm_head", "absent") is None and isinstance(embed, nn.Embedding):
        head = _quantize(embed.weight, None, "lm_head", head_mode, group_size, report, plan,
                         clip_search)
        if head is not None:  # tied: the head gets its own quantized copy, the embedding INT8
            model.lm_head = head
            if isinstance(head, Int8Linear):  # same per-row quantization: share it
                inner.embed_tokens = Int8Embedding(head.qweight, head.scales, embed.weight.dtype)
            elif isinstance(head, Int8GroupLinear):  # same groups: the GGUF path's sharing
                inner.embed_tokens = Int8GroupEmbedding(head, embed.weight.dtype)
            else:
                inner.embed_tokens = Int8Embedding.from_float(embed.weight)
    report.bytes_after = weight_bytes(model)
    for (k, g), names in report.fallbacks.items():  # one line per shape, not per layer
        log.warning("int4 group %d does not divide in_features %d: %d layers (%s%s) use group %d",
                    group_size, k, len(names), ", ".join(names[:3]),
                    ", ..." if len(names) > 3 else "", g)
    log.info("quantized: %s", report)
    return report
