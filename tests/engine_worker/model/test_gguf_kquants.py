"""GGUF-native K-quant and Q5 files (issue 22): tiny random models of each family (Llama with
its permuted q/k, Llama 3.1's rope_freqs, Qwen2 with q/k/v biases and an untied head, Mistral)
written as GGUF files mixing Q4_K, Q5_K, Q6_K, Q5_0, Q5_1 and Q8_0 tensors, served from their
own blocks: the exact mode equals a float model of the same weights, and the integer-dot mode
(every matmul through the kernel, each tensor held once) gives its greedy answers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from engine_worker.model.config import ModelConfig
from engine_worker.model.ggml_types import Blocks, convert
from engine_worker.model.gguf_native import BlockEmbedding, Parts, legacy_only, load_gguf_model
from engine_worker.model.int_dot_linear import IntDotLinear
from engine_worker.model.layers import rope_inv_freq
from engine_worker.model.loader import load_config
from engine_worker.model.matmul_plan import MatmulPlan
from engine_worker.model.weights import load_model
from tests.engine_worker.gguf_factory import served_state, write_state_gguf
from tests.engine_worker.kquant_factory import quantize
from tests.engine_worker.model.test_gguf_native import _logits
from tests.numerics import MARGIN, top2_gap

EXACT = MatmulPlan(use_kernel=False)  # every layer dequantizes: the file's float32 values

Q = gguf.GGMLQuantizationType
DIMS = {"vocab_size": 512, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "initializer_range": 0.1}
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
PROMPT = [5, 17, 300, 42, 9, 511, 128, 64, 3, 77, 200, 11]


def _types(table: dict[str, Q], default: Q) -> Callable[[str], Q]:
    return lambda name: next((q for key, q in table.items() if key in name), default)


# family -> (transformers config, GGUF arch, tensor types by name part)
VARIANTS: dict[str, tuple[Callable[[], Any], str, Callable[[str], Q]]] = {
    "qwen2": (lambda: __import__("transformers").Qwen2Config(**DIMS, tie_word_embeddings=False),
              "qwen2", _types({"v_proj": Q.Q6_K, "o_proj": Q.Q5_0, "gate": Q.Q5_K,
                               "up": Q.Q5_K, "down": Q.Q6_K, "embed": Q.Q4_K,
                               "lm_head": Q.Q6_K}, Q.Q4_K)),
    "llama": (lambda: __import__("transformers").LlamaConfig(**DIMS, tie_word_embeddings=True),
              "llama", _types({"o_proj": Q.Q5_1, "down": Q.Q5_K, "embed": Q.Q8_0}, Q.Q4_K)),
    "llama3": (lambda: __import__("transformers").LlamaConfig(
                   **DIMS, tie_word_embeddings=False,
                   rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, **LLAMA3}),
               "llama", _types({"embed": Q.Q5_0, "lm_head": Q.Q8_0}, Q.Q6_K)),
    "mistral": (lambda: __import__("transformers").MistralConfig(**DIMS, sliding_window=None),
                "llama", _types({"embed": Q.Q6_K}, Q.Q5_0)),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def family(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Path, ModelConfig]:
    """(family, gguf file, float folder of the weights it is served as, config to load with)."""
    from transformers import AutoModelForCausalLM

    kind = request.param
    make_cfg, arch, qtype_of = VARIANTS[kind]
    tmp = tmp_path_factory.mktemp(f"kq-{kind}")
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(make_cfg()).to(torch.float32).eval()
    for layer in hf.model.layers if kind == "qwen2" else []:  # biases start at zero
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            torch.nn.init.normal_(proj.bias, std=0.5)
    hf.save_pretrained(tmp / "hf")
    state = {k: v.numpy() for k, v in hf.state_dict().items()
             if not (k == "lm_head.weight" and hf.config.tie_word_embeddings)}
    cfg = load_config(tmp / "hf")
    extra = None
    if kind == "llama3":  # llama.cpp writes Llama 3.1's scaling as a rope_freqs tensor
        plain = replace(cfg, rope_scaling=None)
        extra = {"rope_freqs.weight": (rope_inv_freq(plain) / rope_inv_freq(cfg)).numpy()}
        cfg = plain  # what a GGUF's metadata gives: no scaling named, the tensor carries it
    path = write_state_gguf(state, tmp / f"{kind}.gguf", arch, qtype_of, cfg.num_heads,
                            cfg.num_kv_heads, extra)
    ref = tmp / "ref"
    ref.mkdir()
    (ref / "config.json").write_text((tmp / "hf" / "config.json").read_text())
    save_file(served_state(state, qtype_of), str(ref / "model.safetensors"))
    return kind, path, ref, cfg


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q5_0, Q.Q5_1])
def test_kernel_formats_hold_the_files_codes(qtype: Q) -> None:
    """Our reference quantizer's blocks read back by gguf's own dequantizer, and our rewrite to a
    kernel format equal to it: exactly for Q5_x, within the fp16 rounding of the K-quants'
    combined scales (under 2 % of a quantization step) for the rest."""
    rng = np.random.default_rng(int(qtype))
    w = rng.standard_normal((24, 512)).astype(np.float32)
    w[:, :32] += 0.7
    raw = quantize(w, qtype)
    theirs = gguf.dequantize(raw, qtype).reshape(w.shape)
    step = np.abs(w).max() / {Q.Q4_K: 7, Q.Q5_K: 15, Q.Q6_K: 31}.get(qtype, 15)
    assert np.abs(theirs - w).max() <= step  # a valid encoding of w
    fmt, ours = convert(qtype, raw, 24, 512)  # type: ignore[misc]
    got = Blocks(fmt, ours, 24, 512).floats()
    if qtype in (Q.Q5_0, Q.Q5_1):
        assert np.array_equal(got, theirs)
    else:
        assert np.abs(got - theirs).max() <= 0.02 * step


def test_exact_mode_equals_the_float_model(family: tuple[str, Path, Path, ModelConfig]) -> None:
    kind, path, ref, cfg = family
    assert not legacy_only(path)
    native = load_gguf_model(path, cfg, "cpu", plan=EXACT)
    want = _logits(load_model(ref, torch.float32, "cpu"), PROMPT)
    torch.testing.assert_close(_logits(native, PROMPT), want, atol=2e-4, rtol=2e-4)
    if kind == "qwen2":  # q|k in Q4_K, v in Q6_K: two layers side by side, biases on both
        assert isinstance(native.model.layers[0].self_attn.qkv_proj, Parts)


def test_int_dot_mode_serves_every_matmul_from_the_blocks(
        int_dot_kernel: None, family: tuple[str, Path, Path, ModelConfig]) -> None:
    kind, path, ref, cfg = family
    model = load_gguf_model(path, cfg, "cpu", plan=MatmulPlan(int_dot_all=True))
    layers = [m for m in model.modules() if isinstance(m, IntDotLinear)]
    assert layers and all(m.fallback is None for m in layers)  # each tensor held once
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert isinstance(model.lm_head, IntDotLinear)
    assert isinstance(model.model.embed_tokens, BlockEmbedding)
    exact = _logits(load_model(ref, torch.float32, "cpu"), PROMPT)
    got = _logits(model, PROMPT)  # 12 rows; prefill-sized batches take the same kernel
    assert (got - exact).abs().max() < 0.05 * exact.abs().max()
    clear = top2_gap(exact) >= MARGIN
    assert clear.any() and torch.equal(got.argmax(-1)[clear], exact.argmax(-1)[clear])
    rows = torch.randn(70, cfg.hidden_size)  # more than one 64-row group in one call
    down = model.model.layers[0].self_attn.o_proj
    assert torch.equal(down(rows)[65:67], down(rows[65:67]))  # a row's result is its own


def test_verification_rows_equal_one_token_decodes(
        int_dot_kernel: None, family: tuple[str, Path, Path, ModelConfig]) -> None:
    """Speculative verification scores k drafts in one pass; each of its rows must be exactly
    the logits a one-token decode at that position gives (every matmul row-independent, each
    row's attention over its own prefix), or greedy speculation could change the text."""
    from engine_worker.model_runner import ModelRunner
    from engine_worker.runner_config import RunnerConfig
    from engine_worker.step import StepItem

    kind, path, ref, _ = family
    if kind != "qwen2":
        pytest.skip("one family is enough: the runner's layout is the same for all")
    runner = ModelRunner(RunnerConfig(ref, 1 << 22, gguf_path=path))
    prompt, drafts = PROMPT[:9], [33, 400, 7, 250]
    one, many = list(range(0, 4)), list(range(4, 8))  # two block tables, 16 slots a block
    runner.execute([StepItem(prompt, 0, one)])
    singles = [runner.execute([StepItem([t], len(prompt) + j, one)])[0]
               for j, t in enumerate(drafts)]
    runner.execute([StepItem(prompt, 0, many)])
    rows = runner.execute([StepItem(drafts, len(prompt), many, all_logits=True)])
    assert rows.shape[0] == len(drafts)
    for j, want in enumerate(singles):
        assert torch.equal(rows[j], want), j
