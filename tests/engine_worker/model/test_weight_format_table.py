"""A weight format is one kernel and one table row (issue 53): a toy format registered by one
`int_dot.WeightFormat` row, with its kernel an op kestrel::int_dot_<name> written here, serves a
GGUF's Q5_1 tensors as stored. The loader reads them into it, the matmul plan's line names its
route, the C++ decode stack calls its op, and the model's logits are the built-in path's
(Q5_1 rewritten to q8_1) bit for bit. Without the row nothing of it is used."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from torch.library import Library

from engine_worker import int_dot
from engine_worker.model.config import ModelConfig
from engine_worker.model.ggml_types import convert, kernel_format, tensors
from engine_worker.model.gguf_native import load_gguf_model
from engine_worker.model.int_dot_linear import IntDotLinear
from engine_worker.model.matmul_plan import MatmulPlan
from engine_worker.model_runner import ModelRunner
from engine_worker.runner_config import RunnerConfig
from engine_worker.step import StepItem
from tests.engine_worker.gguf_factory import write_state_gguf
from tests.engine_worker.model.test_decode_stack import TABLES, _decode_both_ways
from tests.engine_worker.model.test_gguf_kquants import DIMS
from tests.engine_worker.model.test_gguf_native import _logits

Q = gguf.GGMLQuantizationType
TOY = "q5_1s"  # Q5_1's blocks as stored: fp16 d, fp16 m, 32 fifth bits, 16 bytes of nibbles
PROMPT = [5, 17, 300, 42, 9, 511, 128, 64]
calls = {"toy": 0}


def _pack_toy(raw: np.ndarray | torch.Tensor, n: int, k: int) -> int_dot.Packed:
    """The toy's layout: q8_1's, made from Q5_1's own bytes (the codes and scales unchanged)."""
    q81 = convert(Q.Q5_1, np.asarray(raw), n, k, as_stored=False)
    assert q81 is not None and q81[0] == "q8_1"
    p = int_dot.pack("q8_1", q81[1], n, k)
    return p._replace(fmt=TOY)


def _dequantize_toy(b: torch.Tensor, offset: bool) -> torch.Tensor:
    w = torch.from_numpy(gguf.quants.dequantize(b.numpy().reshape(b.shape[0], -1), Q.Q5_1))
    return w.double().reshape(*b.shape[:2], 32)


@pytest.fixture(scope="module")
def toy_kernel(int_dot_kernel: None) -> Iterator[None]:
    """The toy's kernel: an op in the kernels' namespace (it hands its packed q8_1 blocks to the
    built-in q8_1 kernel and counts its calls), and its shape-only version."""
    lib = Library("kestrel", "FRAGMENT")
    lib.define(f"int_dot_{TOY}(Tensor x, Tensor qs, Tensor d, Tensor m, int n) -> Tensor")

    def kernel(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
               n: int) -> torch.Tensor:
        calls["toy"] += 1
        return torch.ops.kestrel.int_dot_q8_1(x, qs, d, m, n)

    lib.impl(f"int_dot_{TOY}", kernel, "CPU")
    torch.library.register_fake(f"kestrel::int_dot_{TOY}", lib=lib)(
        lambda x, qs, d, m, n: x.new_empty(x.shape[0], n))
    yield
    lib._destroy()


@pytest.fixture
def toy_row(toy_kernel: None) -> Iterator[None]:
    """The one row that adds the format."""
    int_dot.register(int_dot.WeightFormat(TOY, int_dot.BLOCK, 24, _pack_toy, _dequantize_toy,
                                          third=True, ggml="Q5_1"))
    yield
    int_dot.unregister(TOY)


@pytest.fixture(scope="module")
def q5_1_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, ModelConfig]:
    """A tiny random Llama whose layers are Q5_1 (its embedding Q8_0): the file, its config's
    folder, the config."""
    from transformers import LlamaConfig

    from engine_worker.model.loader import load_config

    tmp = tmp_path_factory.mktemp("toy-format")
    torch.manual_seed(0)
    hf = __import__("transformers").AutoModelForCausalLM.from_config(
        LlamaConfig(**DIMS, tie_word_embeddings=True)).to(torch.float32).eval()
    hf.save_pretrained(tmp / "hf")
    cfg = load_config(tmp / "hf")
    state = {k: v.numpy() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    path = write_state_gguf(state, tmp / "toy.gguf", "llama",
                            lambda name: Q.Q8_0 if "embed" in name else Q.Q5_1,
                            cfg.num_heads, cfg.num_kv_heads)
    return path, tmp / "hf", cfg


def _plan(path: Path) -> MatmulPlan:
    """The plan the builder makes for a file the integer-dot kernel serves whole."""
    table = tensors(path)
    kinds = tuple(sorted({kernel_format(t) for name, t in table.items()
                          if name.startswith("blk.") and name.endswith(".weight")
                          and t.shape.size == 2}))
    return MatmulPlan(int_dot_all=True, kinds=kinds,
                      head_kind=kernel_format(table["token_embd.weight"]))


def _formats(model: torch.nn.Module) -> set[str]:
    return {m.packed.fmt for m in model.modules() if isinstance(m, IntDotLinear)}


def test_a_format_is_one_kernel_and_one_table_row(
        q5_1_file: tuple[Path, Path, ModelConfig], toy_row: None) -> None:
    path, _, cfg = q5_1_file
    plan = _plan(path)
    assert plan.kinds == (TOY,)
    assert f"{TOY}: int_dot 1+" in plan.describe()  # the plan line names its route
    model = load_gguf_model(path, cfg, "cpu", plan=plan)
    assert _formats(model) == {TOY, "q8_0"}
    calls["toy"] = 0
    got = _logits(model, PROMPT)
    assert calls["toy"] == 4 * cfg.num_layers  # qkv, o, gate|up, down: each its kernel
    int_dot.unregister(TOY)  # the built-in path: Q5_1 rewritten to q8_1
    try:
        builtin = _plan(path)
        assert builtin.kinds == ("q8_1",)
        base = load_gguf_model(path, cfg, "cpu", plan=builtin)
        assert _formats(base) == {"q8_1", "q8_0"}
        assert torch.equal(got, _logits(base, PROMPT))
    finally:
        int_dot.register(int_dot.WeightFormat(TOY, int_dot.BLOCK, 24, _pack_toy,
                                              _dequantize_toy, third=True, ggml="Q5_1"))


def test_the_decode_stack_calls_the_new_formats_kernel(
        q5_1_file: tuple[Path, Path, ModelConfig], toy_row: None) -> None:
    """The worker's runner builds the file's plan with the toy's route, and its C++ decode
    stack reaches the toy's op through the dispatcher by its name, as any other's: the stack's
    logits and the Python layers' are the same bits."""
    path, folder, cfg = q5_1_file
    runner = ModelRunner(RunnerConfig(folder, 1 << 22, gguf_path=path))
    assert f"{TOY}: int_dot 1+" in runner.plan.describe()
    assert runner.decode_stack is not None
    runner.execute([StepItem(PROMPT, 0, TABLES[0])])
    calls["toy"] = 0
    (fast, _), (slow, _) = _decode_both_ways(runner, [StepItem([40], len(PROMPT), TABLES[0])])
    assert calls["toy"] == 2 * 4 * cfg.num_layers  # the stack's pass, then the Python layers'
    assert torch.equal(fast, slow)


def test_without_the_row_the_toy_is_not_used(q5_1_file: tuple[Path, Path, ModelConfig],
                                             toy_kernel: None) -> None:
    path, _, _ = q5_1_file
    assert TOY not in int_dot.FORMAT_TABLE
    assert _plan(path).kinds == ("q8_1",)
    with pytest.raises(ValueError, match="unknown format"):
        int_dot.pack(TOY, np.zeros((8, 24), np.uint8), 8, 32)
