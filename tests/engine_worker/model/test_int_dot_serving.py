"""The integer-dot kernel inside the model (engine_worker/model/int_dot_linear.py): GGUF-native
layers take it at few rows and fall back to the packed path at more, and the model's answers
stay those of the file's exact dequantization (tiny files of each type, and the real SmolLM2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_worker import int_dot
from engine_worker.model.gguf_native import load_gguf_model
from engine_worker.model.int_dot_linear import IntDotLinear
from engine_worker.model.loader import embedded_gguf_path, load_config
from engine_worker.model.matmul_plan import MatmulPlan
from tests.engine_worker.model.test_gguf_native import PROMPT, _logits, tiny_gguf  # noqa: F401
from tests.numerics import MARGIN, top2_gap

EXACT = MatmulPlan(use_kernel=False)  # every layer dequantizes: the file's float32 values


def test_few_rows_take_the_kernel_and_answer_as_the_exact_path(
        int_dot_kernel: None, tiny_gguf: tuple[Path, Path]) -> None:  # noqa: F811
    path, ref = tiny_gguf
    cfg = load_config(ref)
    exact = _logits(load_gguf_model(path, cfg, "cpu", plan=EXACT), PROMPT)
    model = load_gguf_model(path, cfg, "cpu", plan=MatmulPlan(int_dot_rows=16))
    down = model.model.layers[0].mlp.down_proj
    assert isinstance(down, IntDotLinear) and down.max_rows == 16
    assert isinstance(model.lm_head, IntDotLinear)
    assert model.model.embed_tokens.table is model.lm_head.fallback  # one INT8 table
    fast = _logits(model, PROMPT)  # 11 rows: every matmul through the kernel
    # 8-bit activations in each matmul: close, and the same greedy choices where they are clear
    assert (fast - exact).abs().max() < 0.05 * exact.abs().max()
    clear = top2_gap(exact) >= MARGIN
    assert clear.any() and torch.equal(fast.argmax(-1)[clear], exact.argmax(-1)[clear])


def test_more_rows_than_the_limit_take_the_fallback_exactly(
        int_dot_kernel: None, tiny_gguf: tuple[Path, Path]) -> None:  # noqa: F811
    path, ref = tiny_gguf
    model = load_gguf_model(path, load_config(ref), "cpu", plan=MatmulPlan(int_dot_rows=4))
    layer = model.model.layers[0].self_attn.qkv_proj
    x = torch.randn(6, layer.in_features)  # 6 rows > 4
    torch.testing.assert_close(layer(x), layer.fallback(x), rtol=0, atol=0)
    few = torch.randn(3, layer.in_features)
    assert not torch.equal(layer(few), layer.fallback(few))  # the kernel's own rounding
    torch.testing.assert_close(layer(few), int_dot.mm(layer.packed, few), rtol=0, atol=0)


@pytest.mark.smollm
def test_smollm2_file_greedy_through_the_kernel_equals_the_exact_path(
        int_dot_kernel: None, smollm2_dir: Path) -> None:
    path, cfg = embedded_gguf_path(), load_config(smollm2_dir)
    exact = _logits(load_gguf_model(path, cfg, "cpu", plan=EXACT), PROMPT)
    fast = _logits(load_gguf_model(path, cfg, "cpu", plan=MatmulPlan(int_dot_rows=16)), PROMPT)
    clear = top2_gap(exact) >= MARGIN
    assert clear.sum() >= 3
    assert torch.equal(fast.argmax(-1)[clear], exact.argmax(-1)[clear])
    # Activations rounded to 8 bits in every matmul (as llama.cpp's Q8 dot products do): the
    # next-token distribution moves by ~0.01 nats (KL, measured here; bfloat16 packed: ~0.001).
    exact_lp, fast_lp = exact.log_softmax(-1), fast.log_softmax(-1)
    kl = (exact_lp.exp() * (exact_lp - fast_lp)).sum(-1)
    assert kl.mean() < 0.03 and kl.max() < 0.15, kl
