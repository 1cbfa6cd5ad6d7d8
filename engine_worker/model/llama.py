"""Our Llama-family decoder (SmolLM2, Llama 2/3, Qwen2, Mistral) over a flat, varlen batch.

Data flow of one forward:

    input_ids (N,), positions (N,)      N tokens of several sequences, one flat batch
      -> embed                          (N, C)
      -> per layer: RMSNorm -> qkv (one matmul) -> RoPE on q,k -> write k,v at slot_mapping
                    -> attention (decodes: one batched SDPA; each prefill chunk: its own SDPA)
                    -> o_proj + residual -> RMSNorm -> SwiGLU MLP + residual
      -> rows at logits_indices -> RMSNorm -> LM head -> float32 logits (M, V)
         (or, for embeddings, the RMSNorm's output itself: float32 hidden states (M, C))

Where the runner has built one (GGUF layers on the integer-dot kernel, CPU), the decode rows
of a step go through every layer in one C++ call instead (model/decode_stack.py: the same ops,
bit for bit), and the prefill rows through the layers here on their own.

The batch layout and attention are in attention.py; RoPE, the CPU-tuned linear and RMSNorm in
layers.py.

Weights keep Hugging Face names except two fusions done by the loader: q/k/v -> `qkv_proj`,
gate/up -> `gate_up_proj`, so each is one matmul. Compute stays in the weights' dtype (RMSNorm
statistics in float32, as transformers does); logits are returned in float32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine_worker.kv_cache import KVCache
from engine_worker.model.attention import Attention, AttnMeta
from engine_worker.model.config import ModelConfig
from engine_worker.model.layers import Linear, RMSNorm, linear, rope_inv_freq


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
    def __init__(self, cfg: ModelConfig, norm_kernel: bool = False) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, norm_kernel)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, norm_kernel)
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
    def __init__(self, cfg: ModelConfig, norm_kernel: bool = False) -> None:
        super().__init__()
        # Given its (meta) weight, Embedding skips reset_parameters: a random init on the meta
        # device goes through torch's Python refs and imports torch._dynamo (2.7 s a start).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, norm_kernel) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, norm_kernel)


class LlamaForCausalLM(nn.Module):
    """The whole model. Call `init_rope` once (the loader does) before the first forward.
    `norm_kernel`: the norms take the C++ decode stack's RMSNorm (model/layers.py), where the
    matmul plan runs decode rows through the stack."""

    def __init__(self, cfg: ModelConfig, norm_kernel: bool = False) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, norm_kernel)
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
        dtype: torch.dtype | None = None, freq_factors: torch.Tensor | None = None,
    ) -> None:
        """Precompute cos and signed sin tables (max_positions, 1, D) in the model dtype, on the
        weights' device (or the ones given, for an embedding with no float weight): a step then
        only indexes them by position. `freq_factors` (D/2,): a GGUF's `rope_freqs` tensor (how
        llama.cpp's converter writes Llama 3.1's RoPE scaling) divides the inverse frequencies."""
        w = self.model.embed_tokens.weight if device is None or dtype is None else \
            torch.empty(0, device=device, dtype=dtype)
        pos = torch.arange(max_positions, dtype=torch.float32)
        inv_freq = rope_inv_freq(self.config)
        if freq_factors is not None:
            inv_freq = inv_freq / freq_factors.float()
        freqs = torch.outer(pos, inv_freq)  # (P, D/2)
        cos, sin = freqs.cos(), freqs.sin()
        # Computed in float32 and then cast, as the reference does, so both see the same values.
        self.rope_cos = torch.cat((cos, cos), -1).to(w.device, w.dtype).unsqueeze(1)  # (P, 1, D)
        self.rope_sin = torch.cat((-sin, sin), -1).to(w.device, w.dtype).unsqueeze(1)

    def use_cpu_layout(self) -> None:
        """Store large Linear weights K-major when running float32 on CPU (see `Linear`)."""
        for m in self.modules():
            if isinstance(m, Linear):
                m.use_k_major()

    def _layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttnMeta,
                kv_cache: KVCache | None) -> torch.Tensor:
        for i, layer in enumerate(self.model.layers):
            k_cache = kv_cache.k[i] if kv_cache is not None else None
            v_cache = kv_cache.v[i] if kv_cache is not None else None
            x = layer(x, cos, sin, meta, k_cache, v_cache)
        return x

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
        hidden: bool = False,  # the final norm's output (M, C) instead of logits (embeddings)
        # decode rows through one C++ call for every layer (model/decode_stack.py; the runner
        # passes it where the plan has one); None keeps the Python layers for every row
        stack: Callable[..., torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if self.rope_cos is None or self.rope_sin is None:
            raise RuntimeError("call init_rope(max_positions) before forward")
        cos = self.rope_cos.index_select(0, positions)  # (N, 1, D)
        sin = self.rope_sin.index_select(0, positions)
        x = self.model.embed_tokens(input_ids)  # (N, C)
        b = meta.num_decode
        if stack is not None and b and kv_cache is not None \
                and x.dtype == torch.float32 \
                and not torch.compiler.is_compiling():
            # decode rows through the C++ stack (model/decode_stack.py), prefill rows apart
            xd = stack(x[:b], cos[:b], sin[:b], kv_cache, meta)  # (B, C)
            if b == x.shape[0]:
                x = xd
            else:
                rest = self._layers(x[b:], cos[b:], sin[b:], meta.prefill_rows(), kv_cache)
                x = torch.cat((xd, rest))
        else:
            x = self._layers(x, cos, sin, meta, kv_cache)
        if logits_indices is not None:
            x = x.index_select(0, logits_indices)  # (M, C): only rows we sample from
        x = self.model.norm(x)
        if hidden:
            return x.float()  # (M, C)
        if self.lm_head is not None:
            return self.lm_head(x).float()  # (M, V)
        return linear(x, self.model.embed_tokens.weight).float()  # (M, V), tied head
