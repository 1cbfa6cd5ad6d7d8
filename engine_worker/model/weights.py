"""Reading a float checkpoint's weights into our model (no transformers import).

    folder --load_model--> *.safetensors (or pytorch_model*.bin) -> fuse q/k/v and gate/up
                          -> LlamaForCausalLM built on the meta device, weights assigned in place
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from engine_worker.model.config import ModelConfig
from engine_worker.model.llama import LlamaForCausalLM
from engine_worker.model.loader import load_config, read_json


def _weight_files(path: Path) -> list[Path]:
    """The checkpoint's weight files, preferring safetensors; an index names the shards."""
    for index, single in (
        ("model.safetensors.index.json", "model.safetensors"),
        ("pytorch_model.bin.index.json", "pytorch_model.bin"),
    ):
        if (path / index).is_file():
            shards = sorted(set(read_json(path / index)["weight_map"].values()))
            return [path / s for s in shards]
        if (path / single).is_file():
            return [path / single]
    # Some folders hold only unindexed shards; "consolidated.*" files duplicate them in another
    # naming scheme (Mistral), so only model*.safetensors count.
    shards = sorted(path.glob("model*.safetensors"))
    if shards:
        return shards
    raise FileNotFoundError(f"no model.safetensors or pytorch_model.bin in {path}")


def _read_weights(files: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in files:
        if f.suffix == ".safetensors":
            state.update(load_file(str(f)))
        else:
            state.update(torch.load(f, map_location="cpu", weights_only=True, mmap=True))
    return state


def _fuse(
    raw: dict[str, torch.Tensor], cfg: ModelConfig, dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    """HF names -> our names: q/k/v concatenated into qkv_proj, gate/up into gate_up_proj."""
    def take(name: str) -> torch.Tensor:
        return raw.pop(name).to(device=device, dtype=dtype)

    out: dict[str, torch.Tensor] = {}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        for kind in ("weight", "bias"):
            if f"{p}self_attn.q_proj.{kind}" in raw:
                parts = [take(f"{p}self_attn.{x}_proj.{kind}") for x in "qkv"]
                out[f"{p}self_attn.qkv_proj.{kind}"] = torch.cat(parts, dim=0)
            if f"{p}mlp.gate_proj.{kind}" in raw:
                parts = [take(f"{p}mlp.{x}_proj.{kind}") for x in ("gate", "up")]
                out[f"{p}mlp.gate_up_proj.{kind}"] = torch.cat(parts, dim=0)
    for name in list(raw):
        if "rotary_emb.inv_freq" in name:
            continue  # old checkpoints store RoPE buffers; we compute our own
        out[name] = take(name)
    return out


def load_model(
    path: Path,
    dtype: torch.dtype,
    device: str | torch.device,
    max_positions: int | None = None,
) -> LlamaForCausalLM:
    """Our model with the checkpoint's weights, in `dtype` on `device`, RoPE tables for
    `max_positions` (default: the checkpoint's context). No transformers import."""
    path, device = Path(path), torch.device(device)
    cfg = load_config(path)
    state = _fuse(_read_weights(_weight_files(path)), cfg, dtype, device)
    tied = cfg.tie_word_embeddings or "lm_head.weight" not in state
    if tied:
        state.pop("lm_head.weight", None)
        if not cfg.tie_word_embeddings:  # no head in the file: the embedding is the only choice
            cfg = replace(cfg, tie_word_embeddings=True)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    # assign=True adopts our tensors instead of copying into (meta) parameters: one copy only.
    model.load_state_dict(state, strict=True, assign=True)
    model.requires_grad_(False).eval()
    model.use_cpu_layout()
    model.init_rope(max_positions or cfg.max_position_embeddings)
    return model
