"""Our Llama-family decoder (SmolLM2, Llama 2/3, Qwen2, Mistral) over a flat, varlen batch.

Data flow of one forward:

    input_ids (N,), positions (N,)      N tokens of several sequences, one flat batch
      -> embed                          (N, C)
      -> per layer: RMSNorm -> qkv (one matmul) -> RoPE on q,k -> write k,v at slot_mapping
                    -> attention (decodes: one batched SDPA; each prefill chunk: its own SDPA)
                    -> o_proj + residual -> RMSNorm -> SwiGLU MLP + residual
      -> rows at logits_indices -> RMSNorm -> LM head -> float32 logits (M, V)

The batch is laid out by the caller (model_runner) as described by `AttnMeta`: the first
`num_decode` rows are single-token decodes of different sequences, then one contiguous span per
prefill chunk. Attention reads earlier tokens from the paged KV cache by gathering whole blocks
(`index_select` over a (num_blocks, block_size, Hkv, D) view), which moves block_size rows at once;
when one sequence's blocks are consecutive the runner passes their first slot instead, and the
read is a free view (the gather is a cold-memory copy: ~40 us per layer and tensor, measured).
On CPU with float32/bfloat16 caches the decodes skip the gather altogether: a C++ kernel
(engine_worker/paged_attention.py) reads K and V in place through `decode_table`; the gather
path stays as the reference and the fallback, and prefill chunks keep it (one SDPA per chunk
over its gathered context, a copy amortised over the chunk's many query rows).
On CPU the decodes' SDPA takes the G = H / Hkv query heads of one KV head as G query rows
((B, Hkv, G, D) against (B, Hkv, T, D)), so one pass over a KV head's K and V serves all G rows;
with `enable_gqa` the CPU flash kernel runs each query head (one row) over them separately, G
reads of the same K/V. CUDA keeps `enable_gqa` (not measured there).

Weights keep Hugging Face names except two fusions done by the loader: q/k/v -> `qkv_proj`,
gate/up -> `gate_up_proj`, so each is one matmul. Compute stays in the weights' dtype (RMSNorm
statistics in float32, as transformers does); logits are returned in float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from engine_worker.kv_cache import KVCache
from engine_worker.model.config import ModelConfig
from engine_worker.paged_attention import paged_decode_attention


@dataclass
class PrefillSpan:
    """Rows [begin, begin+length) of the batch: tokens at positions start_pos.. of one sequence."""

    begin: int
    length: int
    start_pos: int
    # Blocks holding positions [0, start_pos+length) and the (L, S) causal mask over them; both
    # None when start_pos == 0: the chunk's own k,v are then the whole context (plain causal).
    blocks: torch.Tensor | int | None = None  # (nblk,) int64 block ids, or int: first slot of a run
    mask: torch.Tensor | None = None  # (L, S) bool, True = may attend


@dataclass
class AttnMeta:
    """Where each token's K/V goes and what each query may see. Built once per step."""

    slot_mapping: torch.Tensor | None  # (N,) int64; None: run without a cache (prefill from 0)
    block_size: int = 0
    num_decode: int = 0  # the first num_decode rows are one-token decodes
    # (B * nblk,) int64 block ids, each table padded to nblk; or int: B == 1 and its blocks are
    # consecutive, starting at this slot
    decode_blocks: torch.Tensor | int | None = None
    decode_ctx: int = 0  # Tmax: the longest decode context in the batch
    decode_mask: torch.Tensor | None = None  # (B, 1, 1, Tmax) bool; None if all lengths == Tmax
    # The same tables as (B, nblk) int64 and each decode's context length (B,) int64: what the
    # in-place paged kernel reads (engine_worker/paged_attention.py); None when no decodes.
    decode_table: torch.Tensor | None = None
    decode_lens: torch.Tensor | None = None
    prefills: list[PrefillSpan] = field(default_factory=list)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies (D/2,) float32, with the checkpoint's theta and scaling."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    sc = cfg.rope_scaling
    if sc is None:
        return inv_freq
    if sc["rope_type"] == "linear":
        return inv_freq / float(sc["factor"])
    if sc["rope_type"] == "llama3":  # Llama 3.1: stretch low frequencies, keep high ones
        factor, lo = float(sc["factor"]), float(sc["low_freq_factor"])
        hi = float(sc["high_freq_factor"])
        old_ctx = float(sc["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / lo, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_ctx / hi) * ~(wavelen > old_ctx / lo)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported RoPE scaling {sc['rope_type']!r}")


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x (N, h, D) rotated; cos/sin_signed (N, 1, D). sin_signed = [-sin, sin] halves, so that
    rotate_half(x) * sin == cat(x2, x1) * sin_signed exactly, one negation fewer per call."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((x2, x1), dim=-1) * sin_signed


# CPU float32 matmuls. On the AMD hosts we serve from MKL's sgemv is single-threaded, ~11 GB/s.
# Measured faster, per SmolLM2 decode step (538 MB of weights):
#  - several rows (prefill, batched decode): oneDNN, ~1.5x MKL. An internal op (what
#    torch.compile emits for CPU linears), hence the fallback to F.linear where it is absent.
#  - one row (batch-1 decode) on a K-major weight: the K axis cut into `_k_splits` pieces run as
#    one bmm (a GEMV per thread), then summed: ~30 GB/s against oneDNN's ~21.
# Both cost ~15 us a call more than F.linear, so small weights (tiny test models) skip them.
_op = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
_ONEDNN = _op.default if _op is not None and torch.backends.mkldnn.is_available() else None
_FAST_MIN_NUMEL = 1 << 18  # 1 MiB of float32 weights


def _cpu_fast(w: torch.Tensor) -> bool:
    return (
        _ONEDNN is not None
        and w.dtype == torch.float32
        and w.device.type == "cpu"
        and w.numel() >= _FAST_MIN_NUMEL
    )


@lru_cache(maxsize=64)
def _k_splits(k: int, threads: int) -> int:
    """The most pieces (2..threads, at most 8) that cut K evenly; 1 if none does."""
    return next((s for s in range(min(threads, 8), 1, -1) if k % s == 0), 1)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) @ w (N, K)^T + bias -> (M, N), through the fastest kernel we know for the case."""
    if not _cpu_fast(w) or x.dtype != torch.float32 or torch.compiler.is_compiling():
        # compiled (engine_worker/compiled_step.py): Inductor picks the CPU kernel itself
        return F.linear(x, w, bias)
    n, k = w.shape
    s = _k_splits(k, torch.get_num_threads())
    if x.shape[0] == 1 and w.stride(0) == 1 and s > 1:  # (s, 1, K/s) @ (s, K/s, N), summed
        y = torch.bmm(x.view(s, 1, k // s), w.t().view(s, k // s, n)).sum(0)  # (1, N)
        return y if bias is None else y + bias
    return _ONEDNN(x, w, bias, "none", [], "")  # type: ignore[misc]


class Linear(nn.Linear):
    """nn.Linear (quantization swaps it like any other) through `linear`. `use_k_major` re-stores
    the weight as the transpose of an (in, out) tensor: same shape and values for every reader."""

    def use_k_major(self) -> None:
        if _cpu_fast(self.weight) and self.weight.stride(0) != 1:
            self.weight = nn.Parameter(self.weight.t().contiguous().t(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One op instead of six. Statistics in float32 like the reference; float32 results match
        # it bit for bit, half precision within an ulp (it rounds once, after the scaling).
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


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
        # Decodes read K/V in place through their block tables (a C++ kernel, one pass per KV
        # head for its G query rows) instead of gathering them into a copy. The runner turns it
        # on once the kernel has loaded (CPU, float32/bfloat16); the gather below stays the
        # reference and the fallback.
        self.paged_decode = False

    def forward(
        self,
        x: torch.Tensor,  # (N, C)
        cos: torch.Tensor,  # (N, 1, D)
        sin: torch.Tensor,  # (N, 1, D)
        meta: AttnMeta,
        k_cache: torch.Tensor | None,  # (slots, Hkv, D)
        v_cache: torch.Tensor | None,
    ) -> torch.Tensor:
        n, h, hkv, d = x.shape[0], self.h, self.hkv, self.d
        qkv = self.qkv_proj(x).view(n, h + 2 * hkv, d)  # (N, H + 2Hkv, D)
        qk = apply_rope(qkv[:, : h + hkv], cos, sin)  # (N, H + Hkv, D)
        q, k, v = qk[:, :h], qk[:, h:], qkv[:, h + hkv :]  # (N, H, D) (N, Hkv, D) (N, Hkv, D)
        if k_cache is not None and v_cache is not None:
            k_cache.index_copy_(0, meta.slot_mapping, k)
            v_cache.index_copy_(0, meta.slot_mapping, v)

        outs: list[torch.Tensor] = []  # (rows, H, D) pieces in batch-row order
        b, bs = meta.num_decode, meta.block_size
        table, lens = meta.decode_table, meta.decode_lens
        if b and self.paged_decode and table is not None and lens is not None \
                and k_cache is not None and v_cache is not None:
            # (B, H, D), reading each context where it sits: no copy
            outs.append(paged_decode_attention(q[:b], k_cache, v_cache, table, lens, bs))
        elif b:  # all decodes in one SDPA over their padded contexts
            kd, vd = self._context(k_cache, v_cache, meta.decode_blocks, bs, b, meta.decode_ctx)
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
                kp, vp = (t[rows].transpose(0, 1).unsqueeze(0) for t in (k, v))  # (1, Hkv, L, D)
            else:
                end = span.start_pos + span.length
                kp, vp = self._context(k_cache, v_cache, span.blocks, bs, 1, end)  # (1,Hkv,S,D)
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
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of b sequences at positions [0, t): (B, Hkv, T, D) each, from their blocks."""
        if k_cache is None or v_cache is None or blocks is None:
            raise ValueError("attention over earlier tokens needs a KV cache and block tables")
        kv = []
        for cache in (k_cache, v_cache):
            if isinstance(blocks, int):  # one sequence in consecutive slots: a view, no copy
                seq = cache[blocks : blocks + t].unsqueeze(0)  # (1, T, Hkv, D)
            else:
                paged = cache.view(-1, bs, self.hkv, self.d)  # (blocks, bs, Hkv, D)
                seq = paged.index_select(0, blocks).view(b, -1, self.hkv, self.d)[:, :t]
            kv.append(seq.transpose(1, 2))  # (B, Hkv, T, D)
        return kv[0], kv[1]


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused into one matmul."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (N, I) each
        return self.down_proj(F.silu(gate) * up)  # (N, C)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self,
        x: torch.Tensor,  # (N, C)
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttnMeta,
        k_cache: torch.Tensor | None,
        v_cache: torch.Tensor | None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x))  # (N, C)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The whole model. Call `init_rope` once (the loader does) before the first forward."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        # Tied checkpoints reuse the embedding matrix as the LM head: no second copy.
        self.lm_head = (
            None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )
        # Non-persistent buffers: not in checkpoints, but they follow the model in .to().
        self.rope_cos: torch.Tensor | None
        self.rope_sin: torch.Tensor | None
        self.register_buffer("rope_cos", None, persistent=False)
        self.register_buffer("rope_sin", None, persistent=False)

    def init_rope(
        self, max_positions: int, device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        """Precompute cos and signed sin tables (max_positions, 1, D) in the model dtype, on the
        weights' device (or the ones given, for an embedding with no float weight): a step then
        only indexes them by position."""
        w = self.model.embed_tokens.weight if device is None or dtype is None else \
            torch.empty(0, device=device, dtype=dtype)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(pos, rope_inv_freq(self.config))  # (P, D/2)
        cos, sin = freqs.cos(), freqs.sin()
        # Computed in float32 and then cast, as the reference does, so both see the same values.
        self.rope_cos = torch.cat((cos, cos), -1).to(w.device, w.dtype).unsqueeze(1)  # (P, 1, D)
        self.rope_sin = torch.cat((-sin, sin), -1).to(w.device, w.dtype).unsqueeze(1)

    def use_cpu_layout(self) -> None:
        """Store large Linear weights K-major when running float32 on CPU (see `Linear`)."""
        for m in self.modules():
            if isinstance(m, Linear):
                m.use_k_major()

    @property
    def max_positions(self) -> int:
        return 0 if self.rope_cos is None else self.rope_cos.shape[0]

    def forward(
        self,
        input_ids: torch.Tensor,  # (N,) int64
        positions: torch.Tensor,  # (N,) int64
        meta: AttnMeta,
        kv_cache: KVCache | None,
        logits_indices: torch.Tensor | None = None,  # (M,) rows to score; None: all rows
    ) -> torch.Tensor:
        if self.rope_cos is None or self.rope_sin is None:
            raise RuntimeError("call init_rope(max_positions) before forward")
        cos = self.rope_cos.index_select(0, positions)  # (N, 1, D)
        sin = self.rope_sin.index_select(0, positions)
        x = self.model.embed_tokens(input_ids)  # (N, C)
        for i, layer in enumerate(self.model.layers):
            k_cache = kv_cache.k[i] if kv_cache is not None else None
            v_cache = kv_cache.v[i] if kv_cache is not None else None
            x = layer(x, cos, sin, meta, k_cache, v_cache)
        if logits_indices is not None:
            x = x.index_select(0, logits_indices)  # (M, C): only rows we sample from
        x = self.model.norm(x)
        if self.lm_head is not None:
            return self.lm_head(x).float()  # (M, V)
        return linear(x, self.model.embed_tokens.weight).float()  # (M, V), tied head
