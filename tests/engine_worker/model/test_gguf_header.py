"""engine_worker/model/gguf_header.py: the header digest that keys the converted-model cache, and
the tensor table read without gguf-py's parse of the metadata (the same tensors as GGUFReader)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from engine_worker.model.gguf_header import (
    HeaderReader,
    gguf_array_len,
    gguf_string,
    header_digest,
    tensor_table,
)
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


@pytest.fixture(scope="module")
def embedded() -> tuple[Path, gguf.GGUFReader]:
    """The embedded file and gguf-py's reading of it (2.7 s: read once for the module)."""
    from engine_worker.model.loader import embedded_gguf_path

    return embedded_gguf_path(), gguf.GGUFReader(str(embedded_gguf_path()))


def _same_as_gguf_reader(path: Path, reader: gguf.GGUFReader | None = None) -> int:
    ours = tensor_table(path)
    theirs = {t.name: t for t in (reader or gguf.GGUFReader(str(path))).tensors}
    assert list(ours) == list(theirs)
    for name, ref in theirs.items():
        got = ours[name]
        assert (got.tensor_type, got.n_elements, got.n_bytes, got.data_offset) == (
            ref.tensor_type, ref.n_elements, ref.n_bytes, ref.data_offset), name
        assert got.shape.tolist() == ref.shape.tolist(), name
        assert got.data.dtype == ref.data.dtype and got.data.shape == ref.data.shape, name
        assert np.array_equal(got.data, ref.data), name
        assert not got.data.flags.writeable  # a read-only map of the file
    return len(theirs)


def test_the_tensor_table_is_gguf_readers_for_the_embedded_file(
        embedded: tuple[Path, gguf.GGUFReader]) -> None:
    assert _same_as_gguf_reader(*embedded) == 272


def test_the_tensor_table_is_gguf_readers_for_every_type_and_an_alignment(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "mixed.gguf"), "llama")
    w.add_custom_alignment(64)
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(3000)])
    rng = np.random.default_rng(0)
    Q = gguf.GGMLQuantizationType
    for qtype in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K):
        block, size = gguf.GGML_QUANT_SIZES[qtype]  # random blocks: the table, not the values
        blocks = rng.integers(0, 256, (4, 256 // block * size), dtype=np.uint8)
        w.add_tensor(f"w.{qtype.name}", blocks, raw_dtype=qtype)
    w.add_tensor("norm", rng.standard_normal(256).astype(np.float32))
    w.add_tensor("half", rng.standard_normal((3, 8)).astype(np.float16))
    path = finish(w, tmp_path / "mixed.gguf")
    assert _same_as_gguf_reader(path) == 10


def test_a_tensor_past_the_end_of_the_file_is_a_value_error(tmp_path: Path) -> None:
    path = _write(tmp_path / "a.gguf", 2, "x")
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-64])  # the header whole, the tensor's data cut short
    with pytest.raises(ValueError, match="runs past the end of the file"):
        tensor_table(cut)


def _parsed(reader: object) -> dict:
    """Every metadata value as transformers' GGUF loader parses it from a reader."""
    from transformers.integrations.ggml import _gguf_parse_value

    return {name: [_gguf_parse_value(f.parts[i], f.types) for i in f.data]
            for name, f in reader.fields.items()}  # type: ignore[attr-defined]


def test_the_header_reader_gives_transformers_what_gguf_reader_gives(
        tmp_path: Path, embedded: tuple[Path, gguf.GGUFReader]) -> None:
    """Every value type, scalars and arrays, as the GGUF loader reads them; and the embedded
    file's whole metadata (its 49,152 tokens and 48,900 merges) and tensors."""
    w = gguf.GGUFWriter(str(tmp_path / "types.gguf"), "llama")
    T = gguf.GGUFValueType
    values = {T.UINT8: 200, T.INT8: -100, T.UINT16: 60000, T.INT16: -30000, T.UINT32: 4_000_000_000,
              T.INT32: -2_000_000_000, T.FLOAT32: 0.25, T.UINT64: 2**60, T.INT64: -(2**60),
              T.FLOAT64: 1e-300, T.BOOL: True, T.STRING: "héllo ☃"}
    for vtype, value in values.items():
        w.add_key_value(f"x.{vtype.name}", value, vtype)
    w.add_array("x.strings", ["", "a", "Ġthe", "☃☃", "x" * 300])
    w.add_array("x.ints", [-3, 0, 7])
    w.add_array("x.floats", [0.5, -1.5])
    w.add_array("x.bools", [True, False])
    w.add_tensor("token_embd.weight", np.ones((4, 32), dtype=np.float32))
    path = finish(w, tmp_path / "types.gguf")
    for file, theirs in ((path, gguf.GGUFReader(str(path))), embedded):
        ours = HeaderReader(file)
        got, want = _parsed(ours), _parsed(theirs)
        assert list(got) == list(want)
        assert got == want
        for name, f in ours.fields.items():
            assert f.types == theirs.fields[name].types, name
        assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    assert _parsed(HeaderReader(path))["x.STRING"] == ["héllo ☃"]
