"""Serving a GGUF file's own quantized blocks: every matmul over the file's codes.

Data flow of `load_gguf_model(gguf, cfg, device)`:

    GGUFReader (numpy memmap of the file; no float copy of any quantized tensor)
      -> ggml_types.read_tensor: each tensor in one of the integer-dot kernel's formats
         (Q4_0/Q4_1/Q8_0 as stored; Q5_x, K-quants rewritten code for code: see ggml_types)
      -> Llama-architecture files only: q/k rows (and biases) un-permuted (llama.cpp's converter
         interleaves them for its RoPE; rows move whole, so the blocks are untouched)
      -> q|k|v and gate|up concatenated by rows (kept as parts when their formats differ)
      -> a layer per matmul (model/linear_factory.py), as the matmul plan routes its format:
           files with types torch has no packed kernel for: the integer-dot kernel at every row
             count, the file's blocks held once
           else, as measured on this host (engine_worker/path_choice.py): the integer-dot kernel
             up to some rows, torch's packed INT4/INT8 kernels (Q4_x -> INT4 group-32 with
             w = (q - 8) * scale + zero; Q8_0 -> INT8 group-32) and from some rows a dense copy
           no kernel built here: torch's packed layers, float32 for the other formats
         q/k/v biases (Qwen2) added after the matmul, in float32
      -> LlamaForCausalLM built on the meta device with those modules swapped in
      -> the LM head: the file's `output` tensor, or (tied) the token embedding's table itself;
         the embedding decodes only the rows it looks up

With `MatmulPlan(use_kernel=False)` (the exact mode the tests use) the layers reproduce the
file's dequantization to float32 exactly. The config comes from the GGUF's metadata
(engine_worker/model/loader.py), the same ModelConfig the float path reads.
"""

from __future__ import annotations

import logging
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from engine_worker import int_dot
from engine_worker.memory_budget import trim_heap
from engine_worker.model import ggml_types
from engine_worker.model.block_cache import BlockCache
from engine_worker.model.config import ModelConfig
from engine_worker.model.ggml_types import Blocks, cat, read_tensor
from engine_worker.model.int_dot_linear import IntDotLinear
from engine_worker.model.linear_factory import from_blocks
from engine_worker.model.llama import LlamaForCausalLM
from engine_worker.model.matmul_plan import MatmulPlan
from engine_worker.model.quant_group import Int8GroupEmbedding
from engine_worker.model.requantize import requantized

log = logging.getLogger("kestrel.gguf")

_LAYER_NAMES = {  # GGUF suffix -> our (fused) module and its part
    "attn_q": ("self_attn.qkv_proj", 0), "attn_k": ("self_attn.qkv_proj", 1),
    "attn_v": ("self_attn.qkv_proj", 2), "attn_output": ("self_attn.o_proj", 0),
    "ffn_gate": ("mlp.gate_up_proj", 0), "ffn_up": ("mlp.gate_up_proj", 1),
    "ffn_down": ("mlp.down_proj", 0),
}
_NORMS = {"attn_norm": "input_layernorm.weight", "ffn_norm": "post_attention_layernorm.weight"}


def unpermute_rows(n_rows: int, n_head: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation (convert_hf_to_gguf `permute`):
    gguf rows = hf rows viewed (H, 2, D/2) and swapped to (H, D/2, 2)."""
    hf_of_gguf = np.arange(n_rows).reshape(n_head, 2, n_rows // n_head // 2).swapaxes(1, 2)
    order = np.empty(n_rows, dtype=np.int64)
    order[hf_of_gguf.reshape(-1)] = np.arange(n_rows)
    return order


class Parts(nn.Module):
    """Matrices over one input stored in different formats (a file's q|k in Q4_K with v in Q6_K):
    each its own layer, the outputs side by side, as one fused matmul's would be."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


class BlockEmbedding(nn.Module):
    """Token embedding over a table's blocks (any kernel format): decodes the rows looked up.
    No `weight` attribute: there is no float table."""

    def __init__(self, b: Blocks, device: torch.device) -> None:
        super().__init__()
        self.fmt, self.num_embeddings, self.embedding_dim = b.fmt, b.n, b.k
        self.raw: torch.Tensor
        if isinstance(b.raw, np.memmap) and device.type == "cpu":
            # the block cache's own file (model/block_cache.py): only read, its pages shared
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # read-only: never written
                table = torch.from_numpy(b.raw)
        else:  # a copy: a view would keep the whole file's mapping alive (and resident)
            table = torch.from_numpy(np.array(b.raw)).to(device)
        self.register_buffer("raw", table)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.raw.index_select(0, ids.reshape(-1))
        w = int_dot.dequantize(self.fmt, rows, rows.shape[0], self.embedding_dim)
        return w.to(torch.float32).reshape(*ids.shape, self.embedding_dim)


class ModelRefused(ValueError):
    """A model file this worker will not serve; its message is one line naming what is wrong."""


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """(rows, columns) of every matrix, (length,) of every vector, by GGUF tensor name, as the
    architecture and the vocabulary in `cfg` require."""
    hidden, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    inter = cfg.intermediate_size
    want: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (cfg.vocab_size, hidden), "output.weight": (cfg.vocab_size, hidden),
        "output_norm.weight": (hidden,)}
    for i in range(cfg.num_layers):
        for suffix, shape in (("attn_q", (q, hidden)), ("attn_k", (kv, hidden)),
                              ("attn_v", (kv, hidden)), ("attn_output", (hidden, q)),
                              ("ffn_gate", (inter, hidden)), ("ffn_up", (inter, hidden)),
                              ("ffn_down", (hidden, inter))):
            want[f"blk.{i}.{suffix}.weight"] = shape
            want[f"blk.{i}.{suffix}.bias"] = shape[:1]
        for suffix in _NORMS:
            want[f"blk.{i}.{suffix}.weight"] = (hidden,)
    return want


def check_shapes(tensors: dict[str, Any], cfg: ModelConfig) -> None:
    """Refuse a file whose tensors do not fit its own architecture and vocabulary (an embedding
    with fewer rows than the vocabulary would load, then end the worker at the first request
    whose token it lacks): ModelRefused naming the first tensor that is wrong or missing."""
    # The architecture's own biases are not optional: a Qwen2 file without its q/k/v biases
    # loads and serves garbage.
    required = {"attn_q", "attn_k", "attn_v"} if cfg.attention_bias else set()
    if cfg.o_proj_bias:
        required.add("attn_output")
    for name, want in expected_shapes(cfg).items():
        t = tensors.get(name)
        if t is None:
            optional = name == "output.weight" or (
                name.endswith(".bias") and name.split(".")[-2] not in required)
            if optional:
                continue  # a head tied to the embedding; a bias the architecture does not need
            raise ModelRefused(f"the GGUF file has no tensor {name} (expected shape {want}"
                               + (f"; {cfg.model_type} has q/k/v biases)" if
                                  name.endswith(".bias") else ")"))
        got = tuple(int(x) for x in reversed(t.shape.tolist()))  # GGUF lists dims innermost first
        if got != want:
            raise ModelRefused(f"the GGUF file's {name} has shape {got}, but its metadata "
                               f"(vocabulary {cfg.vocab_size}, hidden {cfg.hidden_size}, "
                               f"{cfg.num_layers} layers) needs {want}")


def load_gguf_model(
    gguf_path: Path, cfg: ModelConfig, device: str | torch.device, *,
    plan: MatmulPlan | None = None, max_positions: int | None = None,
    blocks: BlockCache | None = None, requantize: str = "none",
) -> LlamaForCausalLM:
    """Our model over the GGUF's own blocks (see the module docstring), each matmul as `plan`
    routes it (default: torch's packed kernels in bfloat16 on CPU, nothing in front or behind);
    activations float32. The plan's kernels are loaded by the caller (model/builder.py).
    `blocks`: where rewritten blocks are kept between starts (model/block_cache.py).
    `requantize`: a narrower format for the matrices stored wider (a draft model's; see
    model/requantize.py; "none": the file's own blocks)."""
    stored = read_tensor if blocks is None else blocks.read

    def read(t: Any) -> Blocks:
        return requantized(stored(t), requantize)  # "none": stored itself

    served = "" if requantize == "none" else f"@{requantize}"  # its packed layers' cache key
    device = torch.device(device)
    plan = MatmulPlan(device=device.type) if plan is None else plan
    t0 = time.monotonic()
    tensors = ggml_types.tensors(gguf_path)
    check_shapes(tensors, cfg)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, norm_kernel=plan.decode_stack)

    def mk(b: Blocks, bias: torch.Tensor | None = None, head: bool = False,
           key: str = "") -> nn.Module:
        pack = None if blocks is None or device.type != "cpu" else (
            lambda b: blocks.packed(key + served, b.fmt, lambda: b.raw, b.n, b.k))
        return from_blocks(b, plan, device, head, bias, pack)

    floats: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(model.model.layers):
        for target, (parts, biases) in _layer_parts(tensors, i, cfg, read).items():
            parent, _, attr = target.rpartition(".")
            setattr(layer.get_submodule(parent), attr,
                    _fused(parts, biases, mk, f"blk.{i}.{target}"))
        for suffix, name in _NORMS.items():
            floats[f"model.layers.{i}.{name}"] = _float(tensors[f"blk.{i}.{suffix}.weight"])
        if (i + 1) % 10 == 0 or i + 1 == cfg.num_layers:
            log.info("gguf-native weights: layer %d/%d (%.1f s)", i + 1, cfg.num_layers,
                     time.monotonic() - t0)
    floats["model.norm.weight"] = _float(tensors["output_norm.weight"])
    # the embedding table is read a row a token: re-quantized only where it is the head too
    embed = (stored if "output.weight" in tensors else read)(tensors["token_embd.weight"])
    head = read(tensors["output.weight"]) if "output.weight" in tensors else None
    model.rope_cos = model.rope_sin = None
    if head is None and embed.kind == "int8" and not plan.int_dot_all:
        table = mk(embed, head=True, key="lm_head")  # tied: one INT8 table for both
        rows = table.fallback if isinstance(table, IntDotLinear) else table
        model.model.embed_tokens = Int8GroupEmbedding(rows, torch.float32)  # type: ignore
        model.lm_head = table
    else:
        model.lm_head = mk(embed if head is None else head, head=True, key="lm_head")
        model.model.embed_tokens = (
            nn.Embedding.from_pretrained(torch.from_numpy(embed.raw).to(device), freeze=True)
            if embed.fmt == "float" else BlockEmbedding(embed, device))  # type: ignore
    model.load_state_dict({k: v.to(device) for k, v in floats.items()}, strict=False,
                          assign=True)
    left = [n for n, t in model.state_dict(keep_vars=True).items()
            if t is not None and t.is_meta]
    if left:
        raise ValueError(f"GGUF file has no tensors for {left[:5]}")
    model.requires_grad_(False).eval()
    factors = tensors.get("rope_freqs.weight")
    model.init_rope(max_positions or cfg.max_position_embeddings, device, torch.float32,
                    None if factors is None or cfg.rope_scaling else _float(factors))
    trim_heap()  # the numpy temporaries of the rewrite are gone: give their pages back
    log.info("gguf-native weights loaded in %.1f s%s", time.monotonic() - t0,
             "" if blocks is None else f" ({blocks.hits} tensors from the block cache, "
             f"{blocks.writes} written to it; {blocks.packed_hits} packed layers mapped, "
             f"{blocks.packed_writes} written)")
    return model


def _fused(blocks: list[Blocks], biases: list[torch.Tensor | None],
           mk: Any, key: str) -> nn.Module:
    """One layer for matrices over the same input: one matmul when they share a format. `key`
    names it in the block cache (its parts: KEY.0, KEY.1, ...)."""
    bias = None if all(b is None for b in biases) else torch.cat(
        [torch.zeros(p.n) if b is None else b for p, b in zip(blocks, biases, strict=True)])
    if len({b.fmt for b in blocks}) == 1:
        return mk(cat(blocks), bias, key=key)
    return Parts([mk(p, b, key=f"{key}.{j}")
                  for j, (p, b) in enumerate(zip(blocks, biases, strict=True))])


def _layer_parts(tensors: dict[str, Any], i: int, cfg: ModelConfig | None = None,
                 read: Any = read_tensor,
                 ) -> dict[str, tuple[list[Blocks], list[torch.Tensor | None]]]:
    """Layer i's matmuls (q, k, v | o | gate, up | down) and their biases, by target module.
    Llama-architecture files have q/k rows permuted by llama.cpp's converter: undone here."""
    permuted = cfg is not None and cfg.model_type in ("llama", "mistral")
    orders = {} if cfg is None or not permuted else {
        "attn_q": unpermute_rows(cfg.num_heads * cfg.head_dim, cfg.num_heads),
        "attn_k": unpermute_rows(cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads)}
    parts: dict[str, tuple[list[Blocks], list[torch.Tensor | None]]] = {}
    for suffix, (target, _) in sorted(_LAYER_NAMES.items(), key=lambda kv: kv[1][1]):
        b = read(tensors[f"blk.{i}.{suffix}.weight"])
        bias_t = tensors.get(f"blk.{i}.{suffix}.bias")
        bias = None if bias_t is None else _float(bias_t).reshape(-1)
        order = orders.get(suffix)
        if order is not None:
            b = b.take_rows(order)
            bias = None if bias is None else bias[torch.from_numpy(order)]
        blocks, biases = parts.setdefault(target, ([], []))
        blocks.append(b)
        biases.append(bias)
    return parts


def layer_blocks(gguf_path: Path, i: int = 0) -> list[Blocks]:
    """Layer i's matmuls, rows as stored, fused where they share a format (for timing them:
    engine_worker/path_choice)."""
    out = []
    for blocks, _ in _layer_parts(ggml_types.tensors(gguf_path), i).values():
        out += [cat(blocks)] if len({b.fmt for b in blocks}) == 1 else blocks
    return out


def legacy_only(gguf_path: Path) -> bool:
    """Whether every quantized tensor is Q4_0, Q4_1 or Q8_0 (the types torch's packed kernels
    and the measured path choice cover); K-quant and Q5 files are served by int_dot alone."""
    import gguf

    qt = gguf.GGMLQuantizationType
    plain = {qt.F32, qt.F16, qt.BF16, qt.Q4_0, qt.Q4_1, qt.Q8_0}
    return all(t.tensor_type in plain for t in ggml_types.tensors(gguf_path).values())


def _float(t: Any) -> torch.Tensor:
    b = read_tensor(t)
    return torch.from_numpy(np.ascontiguousarray(b.floats()))
