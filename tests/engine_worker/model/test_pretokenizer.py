"""A GGUF's tokenizer, as we write it, gives llama.cpp's own token ids.

tests/data/llama_cpp_token_ids.json holds the ids llama.cpp's llama-tokenize gave for a corpus
(code, digit runs, contractions, accents, CJK, emoji, runs of spaces and newlines, punctuation),
per GGUF file (tests/data/make_llama_cpp_token_ids.py regenerates it). The tokenizer.json that
save_gguf_tokenizer writes, read the way the gateway reads it (TokenizerInfo.tokenizer_json into
`tokenizers`), must give the same ids for every string: SmolLM2's embedded file always, Qwen2.5's
where benchmarks/fetch_qwen_gguf.py left it in the cache.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
from tokenizers import Tokenizer

from engine_worker.config import cache_dir_from_env
from engine_worker.model import pretokenizer
from engine_worker.model.loader import embedded_gguf_path, save_gguf_tokenizer
from engine_worker.model.tokenizer import tokenizer_info
from tests.engine_worker.gguf_factory import finish

DATA = json.loads((Path(__file__).parents[2] / "data" / "llama_cpp_token_ids.json")
                  .read_text(encoding="utf-8"))
QWEN = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"


def _gguf(name: str) -> Path:
    if name == QWEN:
        path = cache_dir_from_env() / "gguf" / QWEN
        if not path.is_file():
            pytest.skip(f"{path} not there (benchmarks/fetch_qwen_gguf.py fetches it)")
        return path
    return embedded_gguf_path()


@pytest.fixture(scope="module", params=[embedded_gguf_path().name, QWEN])
def written(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(file name, the gateway's tokenizer built from what save_gguf_tokenizer wrote). SmolLM2's
    is the run's metadata conversion (tests/conftest.py), which save_gguf_tokenizer wrote this
    run: one ~20 s conversion shared with the tests that read it too."""
    path = _gguf(request.param)
    if request.param == QWEN:
        out = tmp_path_factory.mktemp("tok")
        save_gguf_tokenizer(path, out)
    else:
        out = request.getfixturevalue("smollm2_meta_dir")
    return request.param, Tokenizer.from_str(tokenizer_info(out).tokenizer_json)


def test_gives_llama_cpp_ids(written: tuple[str, Tokenizer]) -> None:
    name, tok = written
    wrong = []
    for text, want in zip(DATA["corpus"], DATA["ids"][name], strict=True):
        got = tok.encode(text, add_special_tokens=False).ids
        if got != want:
            pieces = [[tok.id_to_token(i) for i in ids] for ids in (got, want)]
            wrong.append(f"{text!r}\n  ours      {pieces[0]}\n  llama.cpp {pieces[1]}")
    assert not wrong, f"{len(wrong)} of {len(DATA['corpus'])} strings differ:\n" + "\n".join(wrong)


def test_smollm_is_starcoders_digits_then_gpt2() -> None:
    """SmolLM2's own tokenizer.json: every digit alone, then GPT-2's regex inside ByteLevel."""
    tok = {"model": {"type": "BPE", "vocab": {}, "merges": []}, "pre_tokenizer": None}
    out = pretokenizer.apply_pre_tokenizer(tok, "smollm")
    assert out["pre_tokenizer"] == {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
         "use_regex": True}]}
    assert tok["pre_tokenizer"] is None  # a copy, the input is untouched
    assert pretokenizer.apply_pre_tokenizer(tok, "llama-bpe")["model"]["ignore_merges"] is True


def test_unknown_pre_type_is_refused() -> None:
    tok = {"model": {"type": "BPE", "vocab": {}, "merges": []}}
    with pytest.raises(ValueError, match="'tekken-9'"):
        pretokenizer.apply_pre_tokenizer(tok, "tekken-9")


def _write(path: Path, model: str, pre: str | None) -> Path:
    """A GGUF with only metadata; arrays of strings come before the keys we read."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "ab", "Ġ"])
    w.add_array("tokenizer.ggml.token_type", [1, 1, 1, 1])
    w.add_uint32("llama.context_length", 64)
    w.add_string("tokenizer.ggml.model", model)
    if pre is not None:
        w.add_string("tokenizer.ggml.pre", pre)
    return finish(w, path)


def test_gguf_string_reads_what_gguf_reader_reads(tmp_path: Path) -> None:
    path = _write(tmp_path / "m.gguf", "gpt2", "qwen2")
    fields = gguf.GGUFReader(path).fields
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre"):
        assert pretokenizer.gguf_string(path, key) == fields[key].contents()
    assert pretokenizer.gguf_string(path, "tokenizer.ggml.missing") is None


@pytest.mark.parametrize(("model", "pre", "applied"), [
    ("gpt2", None, "default"),  # no name: llama.cpp's fallback, with a warning
    ("gpt2", "smollm", "smollm"),
    ("llama", "default", None),  # sentencepiece: no pre-tokenizer in llama.cpp, file untouched
])
def test_rewrite_tokenizer_json(tmp_path: Path, model: str, pre: str | None,
                                applied: str | None) -> None:
    path = _write(tmp_path / "m.gguf", model, pre)
    before = {"model": {"type": "BPE", "vocab": {}, "merges": []},
              "pre_tokenizer": {"type": "ByteLevel"}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(before))
    assert pretokenizer.rewrite_tokenizer_json(path, tmp_path) == applied
    after = json.loads((tmp_path / "tokenizer.json").read_text())
    want = before["pre_tokenizer"] if applied is None else \
        pretokenizer.rule_for(applied).pre_tokenizer()
    assert after["pre_tokenizer"] == want
