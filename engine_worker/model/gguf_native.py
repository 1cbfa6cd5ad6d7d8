"""Serving a GGUF file's own quantized blocks: Q4_0/Q4_1 -> INT4 group-32, Q8_0 -> INT8 group-32.

Data flow of `load_gguf_model(gguf, folder, device)`:

    GGUFReader (numpy memmap of the file; no float copy of any quantized tensor)
      -> per tensor, by GGML type:
           Q4_1 blocks (fp16 d, fp16 m, 16 bytes of nibbles)  w = d * q + m
                -> codes q, scale d, zero m + 8d     (our layout: w = (q - 8) * scale + zero)
           Q4_0 blocks (fp16 d, 16 bytes)            w = d * (q - 8) -> scale d, zero 0
           Q8_0 blocks (fp16 d, 32 int8)             w = d * q -> Int8GroupLinear codes/scales
           F32/F16/BF16 (norms)                      -> float tensors
           anything else (K-quants ...)              -> gguf's own dequantize, a float Linear
      -> q/k rows un-permuted (llama.cpp's converter interleaves them for its RoPE; rows move
         whole, so the blocks are untouched), q|k|v and gate|up concatenated by rows
      -> LlamaForCausalLM built on the meta device with those modules swapped in
      -> a tied LM head is the token embedding's Q8_0 table itself (INT8, shared)

The codes are the file's own: nothing is re-quantized. The only rounding is the storage of the
per-block scale and zero in the kernels' compute dtype (bfloat16 on CPU); with
`compute_dtype=torch.float32` (the exact mode the tests use) the layers reproduce the file's
dequantization to float32 exactly. The model's config comes from the converted folder's
config.json (same file as the float path), so both paths share one ModelConfig.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from engine_worker.model.config import ModelConfig
from engine_worker.model.int4 import Int4GroupLinear
from engine_worker.model.int_dot_linear import IntDotLinear
from engine_worker.model.layers import Linear
from engine_worker.model.llama import LlamaForCausalLM
from engine_worker.model.quant_group import Int8GroupEmbedding, Int8GroupLinear

log = logging.getLogger("kestrel.gguf")

_LAYER_NAMES = {  # GGUF suffix -> our (fused) module and its part
    "attn_q": ("self_attn.qkv_proj", 0), "attn_k": ("self_attn.qkv_proj", 1),
    "attn_v": ("self_attn.qkv_proj", 2), "attn_output": ("self_attn.o_proj", 0),
    "ffn_gate": ("mlp.gate_up_proj", 0), "ffn_up": ("mlp.gate_up_proj", 1),
    "ffn_down": ("mlp.down_proj", 0),
}
_NORMS = {"attn_norm": "input_layernorm.weight", "ffn_norm": "post_attention_layernorm.weight"}


class Blocks:
    """One GGUF tensor's rows in a common form: int codes (N, K), per-32 scale and zero
    (N, K/32) float32 (w = (q - 8) * scale + zero for int4; w = q * scale for int8), or floats."""

    def __init__(self, kind: str, codes: np.ndarray, scale: np.ndarray | None = None,
                 zero: np.ndarray | None = None, fmt: str = "",
                 raw: np.ndarray | None = None) -> None:
        self.kind, self.codes, self.scale, self.zero = kind, codes, scale, zero
        # The file's own bytes, (N, K/32 * block bytes), and their GGML type ("q4_0", "q4_1",
        # "q8_0"): what the integer-dot kernel packs (engine_worker/int_dot.py).
        self.fmt, self.raw = fmt, raw

    def take_rows(self, order: np.ndarray) -> Blocks:
        def pick(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else a[order]

        return Blocks(self.kind, self.codes[order], pick(self.scale), pick(self.zero),
                      self.fmt, pick(self.raw))


def read_tensor(t: Any) -> Blocks:
    """A GGUFReader tensor -> Blocks, without dequantizing quantized types we serve."""
    import gguf

    qt = gguf.GGMLQuantizationType
    data, kind = np.asarray(t.data), t.tensor_type
    if kind == qt.Q4_1 or kind == qt.Q4_0:
        per = 20 if kind == qt.Q4_1 else 18
        blk = data.reshape(data.shape[0], -1, per)  # (N, G, bytes)
        d = blk[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # (N, G)
        nib = blk[..., per - 16:]  # (N, G, 16): element j low nibble, j + 16 high
        q = np.concatenate((nib & 0xF, nib >> 4), axis=-1).reshape(data.shape[0], -1)  # (N, K)
        if kind == qt.Q4_1:
            m = blk[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
            zero = m + 8 * d  # w = d*q + m = (q - 8)*d + (m + 8d): exact in float32
        else:
            zero = np.zeros_like(d)
        return Blocks("int4", q, d, zero, "q4_1" if kind == qt.Q4_1 else "q4_0", data)
    if kind == qt.Q8_0:
        blk = data.reshape(data.shape[0], -1, 34)
        d = blk[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        q = blk[..., 2:].copy().view(np.int8).reshape(data.shape[0], -1)  # (N, K)
        return Blocks("int8", q, d, None, "q8_0", data)
    if kind in (qt.F32, qt.F16):
        return Blocks("float", data.astype(np.float32))
    shape = [int(x) for x in reversed(t.shape.tolist())]  # GGUF lists dims innermost first
    return Blocks("float", gguf.dequantize(data, kind).reshape(shape).astype(np.float32))


def unpermute_rows(n_rows: int, n_head: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation (convert_hf_to_gguf `permute`):
    gguf rows = hf rows viewed (H, 2, D/2) and swapped to (H, D/2, 2)."""
    hf_of_gguf = np.arange(n_rows).reshape(n_head, 2, n_rows // n_head // 2).swapaxes(1, 2)
    order = np.empty(n_rows, dtype=np.int64)
    order[hf_of_gguf.reshape(-1)] = np.arange(n_rows)
    return order


def _cat(parts: list[Blocks]) -> Blocks:
    if len(parts) == 1:
        return parts[0]
    kinds = {p.kind for p in parts}
    if len(kinds) != 1:  # mixed types in one fused matrix: dequantize the lot
        return Blocks("float", np.concatenate([dequant(p) for p in parts]))
    def cat(xs: list[np.ndarray | None]) -> np.ndarray | None:
        return None if xs[0] is None else np.concatenate(xs)  # type: ignore[arg-type]

    same = len({p.fmt for p in parts}) == 1 and all(p.raw is not None for p in parts)
    return Blocks(parts[0].kind, cat([p.codes for p in parts]), cat([p.scale for p in parts]),
                  cat([p.zero for p in parts]), parts[0].fmt if same else "",
                  cat([p.raw for p in parts]) if same else None)


def dequant(b: Blocks) -> np.ndarray:
    """The float32 (N, K) matrix a Blocks stands for (the reference the tests compare to)."""
    if b.kind == "float":
        return b.codes
    def rep(a: np.ndarray | None) -> np.ndarray:
        return np.repeat(a, 32, axis=1)

    if b.kind == "int8":
        return b.codes.astype(np.float32) * rep(b.scale)
    return (b.codes.astype(np.float32) - 8) * rep(b.scale) + rep(b.zero)


def to_module(b: Blocks, device: torch.device, compute_dtype: torch.dtype, use_kernel: bool,
              dense_min_rows: int, native_q8: bool = False,
              dense_dtype: torch.dtype = torch.bfloat16, int_dot_rows: int = 0) -> nn.Module:
    """Blocks -> a layer computing x @ w.T (INT4/INT8 for quantized kinds, Linear for float);
    with `int_dot_rows` (the int_dot kernel loaded), up to that many rows take the integer-dot
    kernel over the file's own blocks."""
    layer = _packed_module(b, device, compute_dtype, use_kernel, dense_min_rows, native_q8,
                           dense_dtype)
    if int_dot_rows and b.raw is not None and device.type == "cpu":
        return IntDotLinear.from_gguf(b.fmt, b.raw, layer, int_dot_rows)
    return layer


def _packed_module(b: Blocks, device: torch.device, compute_dtype: torch.dtype,
                   use_kernel: bool, dense_min_rows: int, native_q8: bool,
                   dense_dtype: torch.dtype) -> nn.Module:
    codes = torch.from_numpy(np.ascontiguousarray(b.codes)).to(device)
    if b.kind == "int4":
        n = codes.shape[0]
        kernel = use_kernel and n % 16 == 0
        cd = compute_dtype if kernel else torch.float32
        s = torch.from_numpy(b.scale).to(device, cd)
        z = torch.from_numpy(b.zero).to(device, cd)
        layer = Int4GroupLinear.from_codes(codes.to(torch.int32), s, z, 32, use_kernel=kernel)
        if kernel and dense_min_rows:
            layer.keep_dense(dense_min_rows, torch.from_numpy(dequant(b)).to(device), dense_dtype)
        return layer
    if b.kind == "int8":
        return Int8GroupLinear(codes, torch.from_numpy(b.scale).to(device), use_kernel=use_kernel,
                               dense_min_rows=dense_min_rows, native=native_q8 and use_kernel,
                               compute_dtype=compute_dtype, dense_dtype=dense_dtype)
    n, k = codes.shape
    lin = Linear(k, n, bias=False, device="meta")
    lin.weight = nn.Parameter(codes.to(torch.float32), requires_grad=False)
    return lin


def load_gguf_model(
    gguf_path: Path, cfg: ModelConfig, device: str | torch.device, *,
    max_positions: int | None = None, compute_dtype: torch.dtype = torch.bfloat16,
    use_kernel: bool | None = None, dense_min_rows: int = 0, native_q8: bool = False,
    dense_dtype: torch.dtype = torch.bfloat16, int_dot_rows: int = 0,
) -> LlamaForCausalLM:
    """Our model over the GGUF's own blocks (see the module docstring). Activations float32;
    packed layers compute in `compute_dtype`; Q8_0 layers through our C++ kernel at few rows if
    `native_q8` (loaded by the caller: quant_group.load_group_gemv). Logs progress."""
    import gguf

    device = torch.device(device)
    if use_kernel is None:
        use_kernel = device.type == "cpu"
    t0 = time.monotonic()
    reader = gguf.GGUFReader(str(gguf_path))
    tensors = {t.name: t for t in reader.tensors}
    if cfg.attention_bias or cfg.o_proj_bias or cfg.mlp_bias:
        raise ValueError("GGUF-native loading covers bias-free Llama layers; use --dtype float32")
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    floats: dict[str, torch.Tensor] = {}
    q_order = unpermute_rows(cfg.num_heads * cfg.head_dim, cfg.num_heads)
    k_order = unpermute_rows(cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads)
    def mk(b: Blocks) -> nn.Module:
        return to_module(b, device, compute_dtype, bool(use_kernel), dense_min_rows, native_q8,
                         dense_dtype, int_dot_rows)

    def mk_head(b: Blocks) -> nn.Module:
        # A float32 copy of the head (113 MB for SmolLM2) would serve only batches of many
        # sequences (the head sees one row a sequence); a bfloat16 copy earns its keep there.
        rows = dense_min_rows if dense_dtype == torch.bfloat16 else 0
        return to_module(b, device, compute_dtype, bool(use_kernel), rows, native_q8,
                         int_dot_rows=int_dot_rows)

    for i, layer in enumerate(model.model.layers):
        for target, b in _layer_parts(tensors, i, q_order, k_order).items():
            parent, _, attr = target.rpartition(".")
            setattr(layer.get_submodule(parent), attr, mk(b))
        for suffix, name in _NORMS.items():
            floats[f"model.layers.{i}.{name}"] = _float(tensors[f"blk.{i}.{suffix}.weight"])
        if (i + 1) % 10 == 0 or i + 1 == cfg.num_layers:
            log.info("gguf-native weights: layer %d/%d (%.1f s)", i + 1, cfg.num_layers,
                     time.monotonic() - t0)
    floats["model.norm.weight"] = _float(tensors["output_norm.weight"])
    embed = read_tensor(tensors["token_embd.weight"])
    head = read_tensor(tensors["output.weight"]) if "output.weight" in tensors else None
    model.rope_cos = model.rope_sin = None
    if embed.kind == "int8":  # the head reads the same table unless the file has its own
        table = mk_head(embed)
        rows = table.fallback if isinstance(table, IntDotLinear) else table  # the INT8 table
        model.model.embed_tokens = Int8GroupEmbedding(rows, torch.float32)  # type: ignore
        model.lm_head = table if head is None else mk_head(head)
    else:
        model.model.embed_tokens = nn.Embedding.from_pretrained(
            torch.from_numpy(dequant(embed)).to(device), freeze=True)
        model.lm_head = None if head is None else mk_head(head)
    model.load_state_dict({k: v.to(device) for k, v in floats.items()}, strict=False,
                          assign=True)
    left = [n for n, t in model.state_dict(keep_vars=True).items()
            if t is not None and t.is_meta]
    if left:
        raise ValueError(f"GGUF file has no tensors for {left[:5]}")
    model.requires_grad_(False).eval()
    model.init_rope(max_positions or cfg.max_position_embeddings, device, torch.float32)
    log.info("gguf-native weights loaded in %.1f s", time.monotonic() - t0)
    return model


def _layer_parts(tensors: dict[str, Any], i: int, q_order: np.ndarray | None = None,
                 k_order: np.ndarray | None = None) -> dict[str, Blocks]:
    """Layer i's fused matmuls (q|k|v, o, gate|up, down) as Blocks, by target module."""
    parts: dict[str, list[Blocks]] = {}
    for suffix, (target, _) in sorted(_LAYER_NAMES.items(), key=lambda kv: kv[1][1]):
        b = read_tensor(tensors[f"blk.{i}.{suffix}.weight"])
        order = q_order if suffix == "attn_q" else k_order if suffix == "attn_k" else None
        if order is not None:
            b = b.take_rows(order)
        parts.setdefault(target, []).append(b)
    return {target: _cat(blocks) for target, blocks in parts.items()}


def layer_blocks(gguf_path: Path, i: int = 0) -> list[Blocks]:
    """Layer i's fused matmuls, rows as stored (for timing them: engine_worker/path_choice)."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    return list(_layer_parts({t.name: t for t in reader.tensors}, i).values())


def _float(t: Any) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(read_tensor(t).codes))
