"""A draft's blocks re-quantized to Q4_0 at load (engine_worker/model/requantize.py): llama.cpp's
Q4_0 bit for bit, only where narrower, and a runner that reads fewer bytes a token."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from engine_worker.model.ggml_types import Blocks, read_tensor, tensors
from engine_worker.model.gguf_native import load_gguf_model
from engine_worker.model.loader import load_config
from engine_worker.model.matmul_plan import MatmulPlan
from engine_worker.model.requantize import format_of, quantize_q4_0, requantized
from engine_worker.model_runner import ModelRunner
from engine_worker.runner_config import RunnerConfig
from tests.engine_worker.gguf_factory import finish, write_gguf
from tests.engine_worker.model.test_gguf_native import PROMPT, _logits

Q = gguf.GGMLQuantizationType
EXACT = MatmulPlan(use_kernel=False)  # every layer dequantized: the served bytes' own values


def test_q4_0_quantizer_is_llamacpps_bit_for_bit() -> None:
    w = np.random.default_rng(0).standard_normal((48, 256)).astype(np.float32) * 0.05
    w[1, :32] = 0  # a block of zeros: d = 0, codes 8
    w[2, 32:64] = np.linspace(-1, 3, 32)  # its largest magnitude positive: d < 0
    ours = quantize_q4_0(torch.from_numpy(w))
    assert np.array_equal(ours, gguf.quants.quantize(w, Q.Q4_0))


def test_only_wider_formats_are_requantized() -> None:
    assert [format_of(f, "q4_0") for f in ("q8_0", "q5_0", "q6_k", "q4_k", "q4_1", "float")] \
        == ["q4_0", "q4_0", "q4_0", "q4_k", "q4_0", "float"]  # Q4_1: 5 bits, Q4_K 4.5
    assert format_of("q8_0", "none") == "q8_0"
    with pytest.raises(ValueError, match="q4_0"):
        format_of("q8_0", "q2_k")
    w = np.random.default_rng(1).standard_normal((16, 64)).astype(np.float32)
    q8 = Blocks("q8_0", gguf.quants.quantize(w, Q.Q8_0), 16, 64)
    q4 = requantized(q8, "q4_0")
    assert q4.fmt == "q4_0" and q4.raw.shape == (16, 64 // 32 * 18)
    assert np.array_equal(q4.raw, gguf.quants.quantize(q8.floats(), Q.Q4_0))
    kept = Blocks("q4_0", gguf.quants.quantize(w, Q.Q4_0), 16, 64)
    assert requantized(kept, "q4_0") is kept


@pytest.fixture(scope="module")
def q8_file(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tiny_dir, tmp_path_factory.mktemp("rq") / "q8.gguf", Q.Q8_0, Q.Q8_0)


def test_a_requantized_file_serves_what_llamacpp_requantized_serves(
        q8_file: Path, tiny_dir: Path) -> None:
    """The Q8_0 file re-quantized at load answers exactly as a file whose every matrix was
    re-quantized by gguf's own Q4_0 (the same bytes); and not as the Q8_0 file does."""
    cfg = load_config(tiny_dir)
    other = gguf.GGUFWriter(str(q8_file.with_name("q4.gguf")), "llama")
    for name, t in tensors(q8_file).items():
        b = read_tensor(t)
        if b.fmt == "float":
            other.add_tensor(name, b.raw)
        else:
            other.add_tensor(name, gguf.quants.quantize(b.floats(), Q.Q4_0), raw_dtype=Q.Q4_0)
    q4_file = finish(other, q8_file.with_name("q4.gguf"))
    ours = _logits(load_gguf_model(q8_file, cfg, "cpu", plan=EXACT, requantize="q4_0"), PROMPT)
    theirs = _logits(load_gguf_model(q4_file, cfg, "cpu", plan=EXACT), PROMPT)
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours, _logits(load_gguf_model(q8_file, cfg, "cpu", plan=EXACT),
                                          PROMPT))


def test_a_requantized_runner_reads_fewer_bytes_a_token(
        int_dot_kernel: None, tiny_dir: Path, tmp_path: Path) -> None:
    """Q5_0 layers and a tied Q8_0 head (as the 0.5B Qwen's): every matrix Q4_0 in the plan,
    and the bytes a token reads those of Q4_0's blocks."""
    c = load_config(tiny_dir)
    q5 = write_gguf(tiny_dir, tmp_path / "q5.gguf", Q.Q5_0, Q.Q8_0)
    cfg = RunnerConfig(tiny_dir, gguf_path=q5, kv_budget_bytes=1 << 22)
    own, small = ModelRunner(cfg), ModelRunner(cfg.for_draft(tiny_dir, q5, "q4_0"))
    assert own.plan.kinds == ("q5_0",) and own.plan.head_kind == "q8_0"
    assert small.plan.kinds == ("q4_0",) and small.plan.head_kind == "q4_0"
    assert "q4_0: int_dot 1+; head q4_0: int_dot 1+" in small.plan.describe()
    weights = {name: int(np.prod(t.shape)) for name, t in tensors(q5).items()
               if t.shape.size == 2 and name != "token_embd.weight"}
    layers, head = sum(weights.values()), c.vocab_size * c.hidden_size  # the head: the table
    # each weight of a Q5_0 layer 22/32 bytes, of the Q8_0 head 34/32; of Q4_0 18/32
    saved = layers * (22 - 18) / 32 + head * (34 - 18) / 32
    assert own.decode_read_bytes - small.decode_read_bytes == pytest.approx(saved, rel=0.01)
