"""A GGUF whose tensors do not fit its own metadata is refused at load, naming the tensor
(engine_worker/model/gguf_native.py check_shapes), where it used to load and then end the worker
at the first request whose token id its embedding lacked."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file

from engine_worker.model.gguf_native import ModelRefused, load_gguf_model
from engine_worker.model.loader import load_config
from tests.engine_worker.gguf_factory import write_state_gguf

Q = gguf.GGMLQuantizationType


def _state(tiny_dir: Path) -> dict[str, np.ndarray]:
    return {k: v for f in sorted(tiny_dir.glob("*.safetensors")) for k, v in load_file(f).items()}


def _write(tiny_dir: Path, out: Path, change: dict[str, np.ndarray]) -> Path:
    cfg = load_config(tiny_dir)
    state = {**_state(tiny_dir), **change}
    return write_state_gguf(state, out, "llama", lambda _: Q.Q8_0, cfg.num_heads,
                            cfg.num_kv_heads)


def test_the_tiny_files_own_shapes_load(tiny_dir: Path, tmp_path: Path) -> None:
    path = _write(tiny_dir, tmp_path / "ok.gguf", {})
    load_gguf_model(path, load_config(tiny_dir), "cpu")


@pytest.mark.parametrize("name,rows", [("model.embed_tokens.weight", -64),
                                       ("lm_head.weight", +64)])
def test_an_embedding_short_of_the_vocabulary_or_a_head_beyond_it_is_refused(
        tiny_dir: Path, tmp_path: Path, name: str, rows: int) -> None:
    cfg = load_config(tiny_dir)
    state = _state(tiny_dir)
    w = state.get(name, state["model.embed_tokens.weight"])
    w = w[:rows] if rows < 0 else np.concatenate([w, w[:rows]])
    path = _write(tiny_dir, tmp_path / "bad.gguf", {name: w})
    gguf_name = "token_embd.weight" if "embed" in name else "output.weight"
    with pytest.raises(ModelRefused, match=rf"{gguf_name} has shape \({cfg.vocab_size + rows}, "
                                           rf"{cfg.hidden_size}\).*needs \({cfg.vocab_size}, "):
        load_gguf_model(path, cfg, "cpu")


def test_a_qwen2_file_without_its_qkv_biases_is_refused_and_with_them_loads(
        tiny_dir: Path, tmp_path: Path) -> None:
    """Issue 42: a Qwen2 file without its q/k/v biases loaded and served garbage."""
    import dataclasses

    cfg = dataclasses.replace(load_config(tiny_dir), model_type="qwen2", attention_bias=True)
    bare = _write(tiny_dir, tmp_path / "bare.gguf", {})
    with pytest.raises(ModelRefused, match=r"no tensor blk\.0\.attn_q\.bias .*q/k/v biases"):
        load_gguf_model(bare, cfg, "cpu")
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    biases = {f"model.layers.{i}.self_attn.{p}_proj.bias": np.zeros(n, np.float32)
              for i in range(cfg.num_layers) for p, n in (("q", q), ("k", kv), ("v", kv))}
    load_gguf_model(_write(tiny_dir, tmp_path / "biased.gguf", biases), cfg, "cpu")
