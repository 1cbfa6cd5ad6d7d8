"""The names a worker serves its model under, announced in its Hello.

    --served-model-name a,b | --model default | FILE.gguf | FOLDER ──served_names──▶ ("a", "b")

The first name is the model's id (what responses carry); the others are aliases the gateway lists
in /v1/models and accepts in requests. Without given names: the embedded model's name for the
default, a GGUF file's stem without its quantization suffix (`Foo-7B.Q4_K_M.gguf` -> `Foo-7B`;
never the cache folder it is converted into, whose name carries a hash), else the folder's name.
"""

from __future__ import annotations

import re
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_ALIASES = ("default", "smollm2")
# llama.cpp's file-name conventions: a split part (-00001-of-00003), then a quantization type
# (Q4_0, Q4_K_M, IQ3_XXS, F16, BF16...) after a dot, dash or underscore.
_SPLIT = re.compile(r"-\d{5}-of-\d{5}$")
_QUANT = re.compile(r"[._-](?:I?Q\d(?:_[A-Z0-9]+)*|B?F16|F32|FP16|FP32)$", re.IGNORECASE)


def gguf_model_name(path: Path) -> str:
    stem = _SPLIT.sub("", path.name.removesuffix(".gguf"))
    return _QUANT.sub("", stem) or stem


def served_names(model: str, checkpoint: Path, given: tuple[str, ...]) -> tuple[str, ...]:
    if given:
        return tuple(dict.fromkeys(given))  # a repeated name is one name
    if model.lower() in DEFAULT_MODEL_ALIASES:
        return (DEFAULT_MODEL_NAME,)
    path = Path(model)
    if path.suffix == ".gguf":
        return (gguf_model_name(path),)
    return (checkpoint.name,)
