"""Tests for engine_worker/model/: config reading, RoPE, our forward against transformers', loading.

The reference is transformers' forward on the same checkpoint folder, run in float64: our float32
logits may be at most a few times further from it than transformers' own float32 forward is on
this host (tests/numerics.py), with the same argmax wherever the reference is not tied.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jinja2
import pytest
import torch
from tokenizers import Tokenizer

from engine_worker.model.config import ModelConfig
from engine_worker.model.layers import Linear, rope_inv_freq
from engine_worker.model.loader import embedded_gguf_path, load_config, resolve_checkpoint
from engine_worker.model.tokenizer import tokenizer_info
from engine_worker.model.weights import load_model
from engine_worker.model_runner import ModelRunner
from engine_worker.runner_config import RunnerConfig
from tests.numerics import assert_logits_close

REPO = Path(__file__).resolve().parents[3]


@torch.inference_mode()
def hf_logits(model: Any, token_ids: list[int]) -> torch.Tensor:
    """transformers' logits (T, V) for one sequence, no cache, in the model's own dtype."""
    return model(torch.tensor([token_ids])).logits[0]


def assert_logits_match(ours: torch.Tensor, hf: Any, token_ids: list[int]) -> None:
    """Our float32 logits against transformers' float64 forward, with its float32 forward as the
    measure of what this host's rounding gives."""
    assert ours.dtype == torch.float32
    exact = hf_logits(copy.deepcopy(hf).double(), token_ids)  # (T, V) float64
    assert_logits_close(ours, exact, peer=hf_logits(hf, token_ids).float())


def random_ids(n: int, seed: int = 0, vocab: int = 49152) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def chat_ids(path: Path, question: str) -> list[int]:
    """A chat prompt rendered with the checkpoint's template, tokenized without transformers."""
    info = tokenizer_info(path)
    assert info.chat_template is not None
    text = jinja2.Template(info.chat_template).render(
        messages=[{"role": "user", "content": question}], add_generation_prompt=True
    )
    return Tokenizer.from_str(info.tokenizer_json).encode(text, add_special_tokens=False).ids


# -- config and RoPE ---------------------------------------------------------------------------

BASE = {
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
}
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


def test_config_reads_both_rope_spellings() -> None:
    new = ModelConfig.from_hf_dict(
        {**BASE, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **LLAMA3}}
    )
    old = ModelConfig.from_hf_dict(
        {**BASE, "rope_theta": 5e5, "rope_scaling": {"type": "llama3", **LLAMA3}}
    )
    assert new == old
    assert new.rope_theta == 5e5 and new.rope_scaling is not None
    assert new.rope_scaling["rope_type"] == "llama3"
    assert new.rope_scaling["original_max_position_embeddings"] == 4096
    plain = ModelConfig.from_hf_dict({**BASE, "rope_theta": 1e4, "eos_token_id": [3, 4]})
    assert plain.rope_scaling is None and plain.head_dim == 16 and plain.eos_token_ids == [3, 4]
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_hf_dict({**BASE, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    qwen = ModelConfig.from_hf_dict({**BASE, "model_type": "qwen2", "sliding_window": 1024})
    assert qwen.attention_bias and not qwen.o_proj_bias and qwen.sliding_window is None


@pytest.mark.parametrize(
    "scaling", [{"rope_type": "linear", "factor": 4.0}, {"rope_type": "llama3", **LLAMA3}]
)
def test_rope_scaling_matches_transformers(scaling: dict[str, Any]) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_theta": 5e5, **scaling}
    if scaling["rope_type"] == "llama3":
        params["original_max_position_embeddings"] = 1024
    hf_cfg = LlamaConfig(**BASE, rope_parameters=params)
    ref, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_cfg, "cpu")
    ours = rope_inv_freq(ModelConfig.from_hf_dict(hf_cfg.to_dict()))
    plain = rope_inv_freq(ModelConfig.from_hf_dict({**BASE, "rope_theta": 5e5}))
    assert not torch.allclose(ref, plain)  # the scaling must matter for this test to mean much
    torch.testing.assert_close(ours, ref, atol=0, rtol=1e-6)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("k", [576, 577])  # 577 is prime: no K split, the oneDNN path
def test_linear_kernels_equal_f_linear(rows: int, k: int) -> None:
    torch.manual_seed(0)
    lin = Linear(k, 1024, bias=True).requires_grad_(False)  # large enough for the fast paths
    x = torch.randn(rows, k)
    ref = torch.nn.functional.linear(x, lin.weight, lin.bias)
    before = lin.weight.clone()
    lin.use_k_major()
    assert lin.weight.stride(0) == 1 and torch.equal(lin.weight, before)  # same shape, values
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), ref, atol=1e-5, rtol=1e-5)


# -- logits against transformers ------------------------------------------------------------------


def test_tiny_logits_match_transformers(tiny_runner: ModelRunner, tiny_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32, local_files_only=True)
    ids = random_ids(96, seed=1)
    assert_logits_match(tiny_runner.forward_full(ids), hf, ids)


def _variant(kind: str, path: Path) -> Any:
    """A tiny transformers model of another family member, saved at `path`."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = {**BASE, "vocab_size": 512, "initializer_range": 0.1}
    cfg = {
        "llama_untied_bias": lambda: LlamaConfig(
            **common, tie_word_embeddings=False, attention_bias=True
        ),
        "llama3_scaled": lambda: LlamaConfig(
            **common,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 5e5,
                **LLAMA3,
                "original_max_position_embeddings": 64,
            },
        ),
        "qwen2_qkv_bias": lambda: Qwen2Config(**common, tie_word_embeddings=True),
        "mistral": lambda: MistralConfig(**common, sliding_window=None),
    }[kind]()
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.float32).eval()
    if kind == "qwen2_qkv_bias":  # biases start at zero: make them count
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize(
    "kind", ["llama_untied_bias", "llama3_scaled", "qwen2_qkv_bias", "mistral"]
)
def test_family_variants_match_transformers(kind: str, tmp_path: Path) -> None:
    hf = _variant(kind, tmp_path)
    runner = ModelRunner(RunnerConfig(tmp_path, kv_budget_bytes=1 << 20))
    ids = random_ids(80, seed=2, vocab=512)
    assert_logits_match(runner.forward_full(ids), hf, ids)


@pytest.mark.smollm
def test_smollm2_logits_match_transformers(
    smollm2_runner: ModelRunner, smollm2_hf: Any, smollm2_dir: Path
) -> None:
    ids = chat_ids(smollm2_dir, "What is the capital of France? Answer in one sentence.")
    ids += random_ids(40, seed=3)  # and some unnatural text, to exercise more of the vocabulary
    assert_logits_match(smollm2_runner.forward_full(ids), smollm2_hf, ids)


def _bf16_agreement(path: Path, ids: list[int], fp32: ModelRunner) -> float:
    bf16 = ModelRunner(RunnerConfig(path, dtype="bfloat16", kv_budget_bytes=4 << 20))
    assert bf16.kv_cache.k[0].dtype == torch.bfloat16
    low = bf16.forward_full(ids)
    assert low.dtype == torch.float32 and torch.isfinite(low).all()
    return (low.argmax(-1) == fp32.forward_full(ids).argmax(-1)).float().mean().item()


def test_bf16_argmax_mostly_agrees_tiny(tiny_runner: ModelRunner, tiny_dir: Path) -> None:
    assert _bf16_agreement(tiny_dir, random_ids(64, seed=4), tiny_runner) >= 0.75


@pytest.mark.smollm
def test_bf16_argmax_mostly_agrees_smollm2(smollm2_runner: ModelRunner, smollm2_dir: Path) -> None:
    ids = chat_ids(smollm2_dir, "Name three colours and explain why the sky is blue.")
    assert _bf16_agreement(smollm2_dir, ids, smollm2_runner) >= 0.75


# -- loading -----------------------------------------------------------------------------------


def test_load_model_needs_no_transformers(tiny_dir: Path) -> None:
    code = (
        "import sys, torch\n"
        "from engine_worker.model.weights import load_model\n"
        f"m = load_model({str(tiny_dir)!r}, torch.float32, 'cpu')\n"
        "assert m.lm_head is None, 'tied checkpoint must reuse the embedding'\n"
        "assert 'transformers' not in sys.modules, 'loading imported transformers'\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]


def test_load_model_places_weights_in_dtype(tiny_dir: Path) -> None:
    model = load_model(tiny_dir, torch.bfloat16, "cpu", max_positions=128)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.max_positions == 128
    assert not any(p.is_meta for p in model.parameters())


def test_resolve_checkpoint_takes_folders_and_refuses_the_rest(
    tiny_dir: Path, tmp_path: Path
) -> None:
    assert resolve_checkpoint(str(tiny_dir), tmp_path) == tiny_dir
    for bad in ("HuggingFaceTB/SmolLM2-135M-Instruct", str(tmp_path), str(tiny_dir / "x.gguf")):
        with pytest.raises(ValueError):
            resolve_checkpoint(bad, tmp_path)


@pytest.mark.smollm
def test_resolve_default_reuses_the_converted_folder(smollm2_dir: Path) -> None:
    assert resolve_checkpoint("smollm2", smollm2_dir.parent) == smollm2_dir
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in smollm2_dir.iterdir()
    }
    assert "quantization_config" not in (smollm2_dir / "config.json").read_text()
    assert not [
        p for p in smollm2_dir.parent.iterdir() if p.name.startswith(f".{smollm2_dir.name}")
    ]


def test_tokenizer_info_reads_plain_files(tiny_dir: Path) -> None:
    info = tokenizer_info(tiny_dir)
    assert info.eos_token == "<|im_end|>" and info.eos_token_ids == [2]
    assert info.chat_template is not None and "<|im_start|>" in info.chat_template
    assert Tokenizer.from_str(info.tokenizer_json).get_vocab_size() == 49152


def _no_conversion(*args: object, **kw: object) -> None:
    raise AssertionError("converted again")


@pytest.mark.smollm
def test_gguf_metadata_folder_holds_no_weights(
        smollm2_dir: Path, smollm2_meta_dir: Path, gguf_meta_cache: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Serving a GGUF from its own blocks needs its config and tokenizer only: no float copy
    of the weights is written, and the config is the one the full conversion reads. The
    conversion is the run's shared one (tests/conftest.py: resolve_checkpoint(weights=False)
    into a folder that was empty), read here, never written to."""
    meta = smollm2_meta_dir
    assert meta.name.endswith("-meta") and meta.parent == gguf_meta_cache
    assert [p.name for p in gguf_meta_cache.iterdir()] == [meta.name]  # no temporary left
    assert not list(meta.glob("*.safetensors")) and (meta / "tokenizer.json").is_file()
    assert load_config(meta) == load_config(smollm2_dir)
    # found again without converting
    monkeypatch.setattr("engine_worker.model.loader.convert_gguf", _no_conversion)
    assert resolve_checkpoint(str(embedded_gguf_path()), gguf_meta_cache, weights=False) == meta
    # a whole conversion, where one exists, serves the metadata too
    assert resolve_checkpoint("default", smollm2_dir.parent, weights=False) == smollm2_dir
