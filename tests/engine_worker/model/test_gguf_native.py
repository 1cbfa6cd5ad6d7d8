"""GGUF-native weights: the file's Q4_0/Q4_1/Q8_0 blocks served packed equal dequantize-then-
float32 (tiny model written with gguf's own writer, and the embedded SmolLM2)."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from engine_worker.model.attention import AttnMeta, PrefillSpan
from engine_worker.model.gguf_native import load_gguf_model, unpermute_rows
from engine_worker.model.int4 import Int4GroupLinear
from engine_worker.model.llama import LlamaForCausalLM
from engine_worker.model.loader import embedded_gguf_path, load_config, resolve_dtype
from engine_worker.model.matmul_plan import MatmulPlan
from engine_worker.model.quant_group import Int8GroupEmbedding, Int8GroupLinear
from engine_worker.model.weights import load_model
from tests.engine_worker.gguf_factory import _permute, reference_state, write_gguf

EXACT = MatmulPlan(use_kernel=False)  # every layer dequantizes: the file's float32 values

Q = gguf.GGMLQuantizationType
PROMPT = [1, 504, 3458, 282, 4649, 314, 5417, 47, 2, 1116, 314]


def _logits(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    meta = AttnMeta(slot_mapping=None, prefills=[PrefillSpan(0, len(ids), 0)])
    with torch.inference_mode():
        return model(torch.tensor(ids), torch.arange(len(ids)), meta, None)  # (T, V)


@pytest.fixture(scope="module", params=[Q.Q4_1, Q.Q4_0, Q.Q8_0], ids=lambda q: q.name)
def tiny_gguf(request: pytest.FixtureRequest, tiny_dir: Path,
              tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(gguf file, folder holding the float32 weights that file dequantizes to)."""
    qtype = request.param
    tmp = tmp_path_factory.mktemp(f"gguf-{qtype.name}")
    cfg = load_config(tiny_dir)
    path = write_gguf(tiny_dir, tmp / "tiny.gguf", qtype, Q.Q8_0, cfg.num_heads,
                      cfg.num_kv_heads)
    ref = tmp / "ref"
    ref.mkdir()
    shutil.copy2(tiny_dir / "config.json", ref / "config.json")
    save_file(reference_state(tiny_dir, qtype, Q.Q8_0), str(ref / "model.safetensors"))
    return path, ref


def test_unpermute_rows_inverts_llamacpp_permute() -> None:
    w = np.arange(96 * 3).reshape(96, 3)
    assert (_permute(w, 6)[unpermute_rows(96, 6)] == w).all()


def test_native_exact_mode_equals_dequantize_then_float32(tiny_gguf: tuple[Path, Path]) -> None:
    path, ref = tiny_gguf
    cfg = load_config(ref)
    native = load_gguf_model(path, cfg, "cpu", plan=EXACT)
    float_model = load_model(ref, torch.float32, "cpu")
    a, b = _logits(native, PROMPT), _logits(float_model, PROMPT)
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    # Quantized layers were adopted, not re-made in float: the packed modules are there
    layer = native.model.layers[0]
    want = Int8GroupLinear if "Q8_0" in path.parent.name else Int4GroupLinear
    assert isinstance(layer.mlp.down_proj, want)
    assert isinstance(native.model.embed_tokens, Int8GroupEmbedding)
    assert native.lm_head is native.model.embed_tokens.table  # one INT8 table, shared


def test_native_kernel_mode_close_to_exact(tiny_gguf: tuple[Path, Path]) -> None:
    path, ref = tiny_gguf
    cfg = load_config(ref)
    exact = _logits(load_gguf_model(path, cfg, "cpu", plan=EXACT), PROMPT)
    copy = MatmulPlan(dense_min_rows=4, head_dense_rows=4)
    fast = _logits(load_gguf_model(path, cfg, "cpu", plan=copy), PROMPT)
    # bfloat16 scales and activations in the kernels: close, and the same greedy choices
    assert (fast - exact).abs().max() < 0.05 * exact.abs().max()
    assert (fast.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("rows", [1, 3, 4, 16])
def test_int8_group_kernels_match_dequantized(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    codes = torch.randint(-127, 128, (96, 64), dtype=torch.int8, generator=g)
    scales = torch.rand(96, 2, generator=g) / 100
    routes = MatmulPlan(head_dense_rows=4).routes("int8_groups", True)
    layer = Int8GroupLinear(codes, scales, routes)
    x = torch.randn(rows, 64, generator=g)
    want = x @ layer.dequantize().t()
    torch.testing.assert_close(layer(x), want, atol=0.05 * want.abs().max().item(), rtol=0.02)
    ids = torch.tensor([5, 0, 95])
    assert torch.equal(layer.rows(ids, torch.float32), layer.dequantize()[ids])


def test_resolve_dtype_auto() -> None:
    gguf_file = embedded_gguf_path()
    assert resolve_dtype("auto", "default", "none", Path(".")) == ("float32", gguf_file)
    assert resolve_dtype("auto", str(gguf_file), "int4", Path(".")) == ("float32", None)
    assert resolve_dtype("float32", "default", "none", Path(".")) == ("float32", None)
    assert resolve_dtype("half", "default", "none", Path(".")) == ("float16", None)


@pytest.mark.smollm
def test_smollm2_native_equals_transformers_dequantized(smollm2_dir: Path) -> None:
    """The embedded Q4_1 file served natively (exact mode) against transformers' own
    dequantization of it to float32 (the converted folder)."""
    cfg = load_config(smollm2_dir)
    native = load_gguf_model(embedded_gguf_path(), cfg, "cpu", plan=EXACT)
    a = _logits(native, PROMPT)
    del native
    b = _logits(load_model(smollm2_dir, torch.float32, "cpu"), PROMPT)
    torch.testing.assert_close(a, b, atol=5e-4, rtol=1e-4)


def test_int4_dense_copy_for_many_rows_matches_packed_kernel() -> None:
    g = torch.Generator().manual_seed(0)
    layer = Int4GroupLinear.from_float(torch.randn(64, 96, generator=g), group_size=32)
    x = torch.randn(8, 96, generator=g)
    packed = layer(x)
    routes = MatmulPlan(dense_min_rows=4).routes("q4_0")  # int4 for 1-3 rows, the copy from 4
    copy = Int4GroupLinear(layer.qweight, layer.scales_zeros, 32, None, routes,
                           layer.dequantize().to(torch.bfloat16))
    torch.testing.assert_close(copy(x), packed, atol=0.05, rtol=0.02)  # 8 rows: dense copy
    torch.testing.assert_close(copy(x[:2]), packed[:2], atol=0, rtol=0)  # 2 rows: packed
