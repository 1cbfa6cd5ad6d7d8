"""Served names (GGUF stems without quant suffixes, aliases) and the KV budget's spellings."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_worker.memory_budget import kv_budget_bytes, parse_kv_memory
from engine_worker.naming import gguf_model_name, served_names


@pytest.mark.parametrize("file,name", [
    ("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
    ("Llama-3.2-1B-Instruct-Q4_K_M.gguf", "Llama-3.2-1B-Instruct"),
    ("qwen2-0_5b-instruct-q8_0.gguf", "qwen2-0_5b-instruct"),
    ("Mistral-7B-v0.3.IQ3_XXS.gguf", "Mistral-7B-v0.3"),
    ("model-BF16-00001-of-00002.gguf", "model"),
    ("plain.gguf", "plain"),
    ("Q4_0.gguf", "Q4_0"),  # nothing would be left: keep the stem
])
def test_gguf_name_drops_the_quant_suffix(file: str, name: str) -> None:
    assert gguf_model_name(Path("/models") / file) == name


def test_served_names_given_default_gguf_and_folder() -> None:
    ckpt = Path("/cache/Foo.Q8_0-0123456789ab")
    assert served_names("x.gguf", ckpt, ("a", "b", "a")) == ("a", "b")
    assert served_names("default", ckpt, ()) == ("SmolLM2-135M-Instruct",)
    assert served_names("/m/Foo.Q8_0.gguf", ckpt, ()) == ("Foo",)
    assert served_names("/m/folder", Path("/m/folder"), ()) == ("folder",)


def test_kv_memory_spellings() -> None:
    assert parse_kv_memory("") is None
    assert parse_kv_memory("0.25") == 0.25
    assert parse_kv_memory("2GiB") == 2 * 2**30 and parse_kv_memory("512MB") == 512 * 10**6
    assert parse_kv_memory("1048576") == 2**20 and parse_kv_memory("1") == 1
    for bad in ("0", "-1", "1.5x", "lots"):
        with pytest.raises(ValueError):
            parse_kv_memory(bad)


def test_kv_budget_bytes_mb_bytes_and_fraction() -> None:
    assert kv_budget_bytes("", 64, "cpu") == 64 * 2**20
    assert kv_budget_bytes("3MiB", 64, "cpu") == 3 * 2**20
    assert 0 < kv_budget_bytes("0.001", 64, "cpu") < 2**40
