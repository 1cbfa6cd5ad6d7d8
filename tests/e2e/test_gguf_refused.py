"""A worker given a GGUF whose token embedding is short of its vocabulary (the default SmolLM2
file, copied with its last 1,000 embedding rows cut) refuses it at start: it exits 2 with one
log line naming the tensor, no traceback, and never joins the gateway. It used to load, then
die at the first request whose token id the embedding lacked."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import httpx
import pytest

from engine_worker.model.loader import embedded_gguf_path
from tests.engine_worker.gguf_factory import finish
from tests.procs import GatewayProc, WorkerProc

CUT = 1000


def copy_with_short_embedding(src: Path, out: Path) -> Path:
    """Every metadata field and tensor of `src`, token_embd.weight without its last CUT rows."""
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(out), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        data = t.data[:-CUT] if t.name == "token_embd.weight" else t.data
        writer.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    return finish(writer, out)


def short_embedding_file(cache_dir: Path) -> Path:
    """The copy, made once per cache (its metadata folder is then cached beside it too)."""
    out = cache_dir / "test-files" / f"smollm2-short-embedding-{CUT}.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".tmp-{os.getpid()}")
        copy_with_short_embedding(embedded_gguf_path(), tmp)
        os.replace(tmp, out)
    return out


def test_a_gguf_with_a_short_embedding_is_refused_in_one_line(cache_dir: Path) -> None:
    bad = short_embedding_file(cache_dir)
    with GatewayProc() as gw, WorkerProc(bad, gw.engine_address) as wk:
        assert wk.popen is not None
        assert wk.popen.wait(timeout=300) == 2
        gw.wait_live()  # a refusal may come before the gateway listens
        assert httpx.get(gw.base_url + "/health/ready", timeout=5).status_code == 503
    msg = wk.only_error()
    assert msg.startswith("model refused:") and "token_embd.weight" in msg
    assert "49152" in msg  # the vocabulary it is short of


def _truncated(src: Path, out: Path) -> Path:
    data = src.read_bytes()
    out.write_bytes(data[: len(data) // 3])  # the header whole, the tensors cut
    return out


def _absurd_entry_count(src: Path, out: Path) -> Path:
    with open(src, "rb") as f:
        head = bytearray(f.read(1 << 20))
        rest = f.read()
    head[16:24] = (10**12).to_bytes(8, "little")  # n_kv
    out.write_bytes(bytes(head) + rest)
    return out


@pytest.mark.parametrize("make, says", [(_truncated, "ValueError"),
                                        (_absurd_entry_count, "1,000,000,000,000 metadata")],
                         ids=["truncated", "absurd-entry-count"])
def test_a_hostile_gguf_is_refused_in_one_line_without_a_traceback(
        tmp_path: Path, make, says: str) -> None:  # noqa: ANN001
    """Issue 42: hostile GGUFs failed closed but printed Python tracebacks."""
    bad = make(embedded_gguf_path(), tmp_path / "hostile.gguf")
    with WorkerProc(bad, "tcp://127.0.0.1:9", "--cache-dir", str(tmp_path / "cache")) as wk:
        assert wk.popen is not None
        assert wk.popen.wait(timeout=300) == 2
    msg = wk.only_error()
    assert msg.startswith("model refused: the GGUF file did not parse") and says in msg, msg
