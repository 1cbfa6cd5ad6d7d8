"""engine_worker/model/gguf_header.py: the header digest that keys the converted-model cache."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from engine_worker.model.gguf_header import gguf_array_len, gguf_string, header_digest
from engine_worker.model.loader import _converted
from tests.engine_worker.gguf_factory import finish


def _write(path: Path, eos: int, template: str) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_eos_token_id(eos)
    w.add_chat_template(template)
    w.add_tensor("token_embd.weight", np.ones((4, 32), dtype=np.float32))
    return finish(w, path)


def test_an_edit_that_keeps_the_size_changes_the_digest(tmp_path: Path) -> None:
    a = _write(tmp_path / "a.gguf", 2, "{{ messages }}")
    b = _write(tmp_path / "b.gguf", 3, "{{ messagez }}")  # same sizes, other eos and template
    assert a.stat().st_size == b.stat().st_size
    assert header_digest(a) != header_digest(b)
    assert gguf_string(b, "tokenizer.chat_template") == "{{ messagez }}"


def test_the_same_bytes_under_another_name_have_the_same_digest(tmp_path: Path) -> None:
    a = _write(tmp_path / "a.gguf", 2, "{{ messages }}")
    c = tmp_path / "copy.gguf"
    c.write_bytes(a.read_bytes())
    assert header_digest(a) == header_digest(c)
    # the tensor data is not hashed: only what a conversion reads before it
    data = bytearray(a.read_bytes())
    data[-1] ^= 0xFF
    c.write_bytes(bytes(data))
    assert header_digest(a) == header_digest(c)


def test_the_converted_cache_of_an_edited_file_is_a_new_folder(tmp_path: Path,
                                                                  monkeypatch) -> None:  # noqa: ANN001
    """The stale-metadata finding: same path, same size, other eos id -> another conversion."""
    from engine_worker.model import loader

    made: list[Path] = []

    def fake_convert(gguf_path: Path, out: Path, weights: bool = True) -> None:
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        made.append(out)

    monkeypatch.setattr(loader, "convert_gguf", fake_convert)
    path = _write(tmp_path / "m.gguf", 2, "{{ messages }}")
    first = _converted(path, tmp_path / "cache", weights=False)
    assert _converted(path, tmp_path / "cache", weights=False) == first and len(made) == 1
    _write(path, 3, "{{ messages }}")
    second = _converted(path, tmp_path / "cache", weights=False)
    assert second != first and len(made) == 2


def test_a_vocabulary_over_the_limit_is_refused_before_any_conversion(
        tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """Issue 42: a 3,000,000-token vocabulary was not ready in 150 s at 4.25 GB. The count is
    read from the header's array length; the limit is lowered here so the file stays small."""
    import pytest

    from engine_worker.model import loader
    from engine_worker.model.gguf_native import ModelRefused

    w = gguf.GGUFWriter(str(tmp_path / "v.gguf"), "llama")
    w.add_token_list([f"t{i}" for i in range(5000)])
    w.add_tensor("token_embd.weight", np.ones((4, 32), dtype=np.float32))
    path = finish(w, tmp_path / "v.gguf")
    assert gguf_array_len(path, "tokenizer.ggml.tokens") == 5000
    assert gguf_array_len(path, "tokenizer.ggml.scores") is None
    monkeypatch.setattr(loader, "MAX_VOCAB", 4999)
    monkeypatch.setattr(loader, "convert_gguf", lambda *a, **k: pytest.fail("converted"))
    with pytest.raises(ModelRefused, match=r"has 5,000 tokens, over the limit of 4,999"):
        _converted(path, tmp_path / "cache", weights=False)
