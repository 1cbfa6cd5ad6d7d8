"""The model's shape, read once from a Hugging Face `config.json` and never changed after.

Data flow: loader reads config.json (a dict) -> `ModelConfig.from_hf_dict` -> the frozen config that
the model code, the KV cache sizer and the model runner all read. No torch, no transformers here.

Two spellings of RoPE settings exist in the wild: transformers 5 writes
`rope_parameters = {"rope_type": ..., "rope_theta": ..., "factor": ...}`, older checkpoints write
`rope_theta` plus `rope_scaling = {"type"|"rope_type": ..., "factor": ...}`. Both are read; the
result is `rope_theta` plus `rope_scaling` (None for plain RoPE, else a dict with "rope_type").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# RoPE variants the model code implements (see layers.py `rope_inv_freq`).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q, k and v (Qwen2 always; Llama when attention_bias=True)
    bos_token_id: int | None
    eos_token_ids: list[int]
    model_type: str
    o_proj_bias: bool = False  # Llama's attention_bias also puts a bias on o_proj; Qwen2's not
    mlp_bias: bool = False
    # Mistral v0.1 style local attention. We only do full attention, so the runner clamps the
    # context to this window, where full and sliding attention agree.
    sliding_window: int | None = None

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        model_type = str(d.get("model_type", "llama"))
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}"
            )
        num_heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        head_dim = d.get("head_dim") or hidden // num_heads
        rope_theta, rope_scaling = _read_rope(d)

        if model_type == "qwen2":
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = bool(d.get("attention_bias", False))

        eos = d.get("eos_token_id")
        eos_ids = [] if eos is None else [int(e) for e in (eos if isinstance(eos, list) else [eos])]

        window = d.get("sliding_window")
        if model_type == "qwen2" and not d.get("use_sliding_window", False):
            window = None  # Qwen2 configs carry a window they do not use
        max_pos = int(d.get("max_position_embeddings", 2048))
        if window is not None and int(window) >= max_pos:
            window = None  # a window as long as the context is full attention

        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            model_type=model_type,
            o_proj_bias=o_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            sliding_window=None if window is None else int(window),
        )


def _read_rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from either spelling; scaling None means plain RoPE."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" not in params and params:
        # Per-layer-type rope parameters (some newer families): not a Llama-family layout.
        raise ValueError(f"unsupported rope_parameters layout: {params!r}")
    params = dict(params or {})
    theta = float(params.pop("rope_theta", d.get("rope_theta", 10000.0)))
    scaling = params if params.get("rope_type", params.get("type")) else d.get("rope_scaling")
    if not scaling:
        return theta, None
    scaling = dict(scaling)
    rope_type = scaling.pop("type", None)
    rope_type = scaling.setdefault("rope_type", rope_type or "default")
    if rope_type == "default":
        return theta, None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported RoPE scaling {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}"
        )
    if rope_type == "llama3":
        # transformers falls back to the config's context length when this is missing
        scaling.setdefault("original_max_position_embeddings", d.get("max_position_embeddings"))
    return theta, scaling
