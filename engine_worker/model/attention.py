"""Attention over a flat, varlen batch with a paged KV cache (the decoder's, model/llama.py).

The batch is laid out by the caller (model_runner) as described by `AttnMeta`: the first
`num_decode` rows are single-token decodes of different sequences, then one contiguous span per
prefill chunk. Attention reads earlier tokens from the paged KV cache by gathering whole blocks
(`index_select` over a (num_blocks, block_size, Hkv, D) view), which moves block_size rows at once;
when one sequence's blocks are consecutive the runner passes their first slot instead, and the
read is a free view (the gather is a cold-memory copy: ~40 us per layer and tensor, measured).
K and V are written in the cache's dtype (bfloat16 by default on CPU, whatever the activations;
engine_worker/runner_config.py resolve_kv_dtype; or 8-bit codes with their scales,
engine_worker/kv_cache.py) and a gathered context is widened to the queries' dtype for SDPA.
On CPU the decodes skip the gather altogether: a C++ kernel
(engine_worker/paged_attention.py) reads K and V in place through `decode_table`; the gather
path stays as the reference and the fallback, and prefill chunks keep it (one SDPA per chunk
over its gathered context, a copy amortised over the chunk's many query rows).
On CPU the decodes' SDPA takes the G = H / Hkv query heads of one KV head as G query rows
((B, Hkv, G, D) against (B, Hkv, T, D)), so one pass over a KV head's K and V serves all G rows;
with `enable_gqa` the CPU flash kernel runs each query head (one row) over them separately, G
reads of the same K/V. CUDA keeps `enable_gqa` (not measured there).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

from engine_worker import kv_cache
from engine_worker.model.config import ModelConfig
from engine_worker.model.layers import Linear, apply_rope
from engine_worker.paged_attention import paged_decode_attention


@dataclass
class PrefillSpan:
    """Rows [begin, begin+length) of the batch: tokens at positions start_pos.. of one sequence."""

    begin: int
    length: int
    start_pos: int
    # Blocks holding positions [0, start_pos+length) and the (L, S) causal mask over them; both
    # None when start_pos == 0: the chunk's own k,v are then the whole context (plain causal).
    blocks: torch.Tensor | int | None = None  # (nblk,) int64 block ids, or int: a run's first
    mask: torch.Tensor | None = None  # (L, S) bool, True = may attend


@dataclass
class AttnMeta:
    """Where each token's K/V goes and what each query may see. Built once per step."""

    slot_mapping: torch.Tensor | None  # (N,) int64; None: run without a cache (prefill from 0)
    block_size: int = 0
    num_decode: int = 0  # the first num_decode rows are one-token decodes
    # (B * nblk,) int64 block ids, each table padded to nblk; or int: B == 1 and its blocks are
    # consecutive, starting at this block
    decode_blocks: torch.Tensor | int | None = None
    decode_ctx: int = 0  # Tmax: the longest decode context in the batch
    decode_mask: torch.Tensor | None = None  # (B, 1, 1, Tmax) bool; None if all lengths == Tmax
    # The same tables as (B, nblk) int64 and each decode's context length (B,) int64: what the
    # in-place paged kernel reads (engine_worker/paged_attention.py); None when no decodes.
    decode_table: torch.Tensor | None = None
    decode_lens: torch.Tensor | None = None
    prefills: list[PrefillSpan] = field(default_factory=list)
    # Decodes read K/V in place through their block tables (a C++ kernel, one pass per KV head
    # for its G query rows) instead of gathering them into a copy: the runner's choice, where
    # the kernel loaded (CPU, float32/bfloat16); the gather stays the reference and fallback.
    paged: bool = False

    def prefill_rows(self) -> AttnMeta:
        """The same step without its decode rows: the prefill spans alone, from row 0."""
        b = self.num_decode
        return AttnMeta(
            slot_mapping=None if self.slot_mapping is None else self.slot_mapping[b:],
            block_size=self.block_size,
            prefills=[replace(s, begin=s.begin - b) for s in self.prefills])


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.h, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv_out = (self.h + 2 * self.hkv) * self.d
        self.qkv_proj = Linear(cfg.hidden_size, qkv_out, bias=cfg.attention_bias)
        self.o_proj = Linear(self.h * self.d, cfg.hidden_size, bias=cfg.o_proj_bias)
        # CPU decodes group query heads per KV head (measured faster on CPU, issue 10); False
        # keeps the enable_gqa path, the reference the grouped path is tested against.
        self.grouped_decode = True

    def forward(
        self,
        x: torch.Tensor,  # (N, C)
        cos: torch.Tensor,  # (N, 1, D)
        sin: torch.Tensor,  # (N, 1, D)
        meta: AttnMeta,
        k_cache: torch.Tensor | None,  # (Hkv, slots, W): kv_cache.py
        v_cache: torch.Tensor | None,
    ) -> torch.Tensor:
        n, h, hkv, d = x.shape[0], self.h, self.hkv, self.d
        qkv = self.qkv_proj(x).view(n, h + 2 * hkv, d)  # (N, H + 2Hkv, D)
        qk = apply_rope(qkv[:, : h + hkv], cos, sin)  # (N, H + Hkv, D)
        q, k, v = qk[:, :h], qk[:, h:], qkv[:, h + hkv :]  # (N, H, D) (N, Hkv, D) (N, Hkv, D)
        if k_cache is not None and v_cache is not None:  # in the cache's dtype (rounded)
            kv_cache.write(k_cache, meta.slot_mapping, k)
            kv_cache.write(v_cache, meta.slot_mapping, v)

        outs: list[torch.Tensor] = []  # (rows, H, D) pieces in batch-row order
        b, bs = meta.num_decode, meta.block_size
        table, lens = meta.decode_table, meta.decode_lens
        if b and meta.paged and table is not None and lens is not None \
                and k_cache is not None and v_cache is not None:
            # (B, H, D), reading each context where it sits: no copy
            outs.append(paged_decode_attention(q[:b], k_cache, v_cache, table, lens, bs))
        elif b:  # all decodes in one SDPA over their padded contexts
            kd, vd = self._context(k_cache, v_cache, meta.decode_blocks, bs, b, meta.decode_ctx,
                                   q.dtype)
            if self.grouped_decode and kd.device.type == "cpu":
                outs.append(self._decode_grouped(q[:b], kd, vd, meta.decode_mask))
            else:  # CUDA: enable_gqa kept, the grouped form was not measured there
                out = F.scaled_dot_product_attention(  # (B, H, 1, D)
                    q[:b].unsqueeze(2), kd, vd, attn_mask=meta.decode_mask, enable_gqa=True
                )
                outs.append(out.squeeze(2))
        for span in meta.prefills:
            rows = slice(span.begin, span.begin + span.length)
            qp = q[rows].transpose(0, 1).unsqueeze(0)  # (1, H, L, D)
            if span.blocks is None:  # starts at position 0: its own k,v are the whole context
                # as the cache holds them (rounded to its dtype), so that a prompt attends to
                # the same values whether it was prefilled from 0 or after a cached prefix
                kr, vr = k, v
                if k_cache is not None and k_cache.dtype != k.dtype:
                    kr, vr = (kv_cache.decode(kv_cache.encode(t, k_cache.dtype), d, k.dtype)
                              for t in (k, v))
                kp, vp = (t[rows].transpose(0, 1).unsqueeze(0) for t in (kr, vr))  # (1,Hkv,L,D)
            else:
                end = span.start_pos + span.length
                kp, vp = self._context(k_cache, v_cache, span.blocks, bs, 1, end,  # (1,Hkv,S,D)
                                       q.dtype)
            out = F.scaled_dot_product_attention(  # (1, H, L, D)
                qp, kp, vp, attn_mask=span.mask, is_causal=span.blocks is None, enable_gqa=True
            )
            outs.append(out.squeeze(0).transpose(0, 1))  # (L, H, D)
        o = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)  # (N, H, D)
        return self.o_proj(o.reshape(n, h * d))  # (N, C)

    def _decode_grouped(
        self,
        q: torch.Tensor,  # (B, H, D): one query token per sequence
        kd: torch.Tensor,  # (B, Hkv, T, D)
        vd: torch.Tensor,  # (B, Hkv, T, D)
        mask: torch.Tensor | None,  # (B, 1, 1, T) bool or None
    ) -> torch.Tensor:
        """Decode attention with the G = H / Hkv query heads of one KV head as G query rows.

        Query head i uses KV head i // G (the order `enable_gqa` and Hugging Face's repeat_kv
        use), so viewing H as (Hkv, G) pairs each group with its KV head. With `enable_gqa` the
        CPU flash kernel (no copy; profiled) walks each query head's single row over its KV
        head's K and V, so each is read G times; here one pass serves the G rows together.
        """
        b, h, d = q.shape
        qg = q.view(b, self.hkv, h // self.hkv, d)  # (B, Hkv, G, D): a view, H splits cleanly
        out = F.scaled_dot_product_attention(qg, kd, vd, attn_mask=mask)  # (B, Hkv, G, D)
        return out.reshape(b, h, d)  # (B, H, D)

    def _context(
        self,
        k_cache: torch.Tensor | None,
        v_cache: torch.Tensor | None,
        blocks: torch.Tensor | int | None,
        bs: int,
        b: int,
        t: int,
        dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of b sequences at positions [0, t): (B, Hkv, T, D) each, from their blocks
        (kv_cache.gather: block tables, or a run's first block id), in `dtype` (the queries';
        None: the cache's)."""
        if k_cache is None or v_cache is None or blocks is None:
            raise ValueError("attention over earlier tokens needs a KV cache and block tables")
        kv = [kv_cache.gather(cache, blocks, b, t, bs) for cache in (k_cache, v_cache)]
        # SDPA takes one dtype: a 16-bit cache under float32 activations is widened (a copy of
        # the context, as the gather already is; the in-place kernel reads it as it is), an
        # 8-bit one's codes multiplied by their scales
        if kv_cache.is_scaled(k_cache.dtype):
            out = dtype or torch.float32
            return kv_cache.decode(kv[0], self.d, out), kv_cache.decode(kv[1], self.d, out)
        if dtype is None:
            return kv[0], kv[1]
        return kv[0].to(dtype), kv[1].to(dtype)
