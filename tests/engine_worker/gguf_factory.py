"""Write a Llama checkpoint folder's weights as a GGUF file the way llama.cpp's converter does:
GGUF names, q/k rows permuted for its RoPE, 2-D weights quantized (gguf's own numpy quantizer),
norms in F32. `reference_state` gives the float32 weights such a file stands for (gguf's own
dequantizer, HF names and row order): what a dequantize-then-float32 load computes with."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `permute`: HF rows -> GGUF rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def _gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, i, rest = hf.split(".", 3)  # model.layers.I.<module>.weight|bias
    module, kind = rest.rsplit(".", 1)
    return f"blk.{i}.{_NAMES[module]}.{kind}"


def finish(writer: gguf.GGUFWriter, out: Path) -> Path:
    """Write what `writer` holds (header, metadata, tensors) to its file, close it: `out`."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def write_state_gguf(state: dict[str, np.ndarray], out: Path, arch: str,
                     qtype_of: Callable[[str], gguf.GGMLQuantizationType], heads: int,
                     kv_heads: int, extra: dict[str, np.ndarray] | None = None) -> Path:
    """HF-named float weights -> a GGUF of `arch` (tensors only): 2-D weights in the type
    `qtype_of(hf name)` gives (K-quants by tests/engine_worker/kquant_factory.py), 1-D ones
    (norms, biases) F32; q/k rows and biases permuted as llama.cpp's converter does for "llama"
    only. `extra`: more F32 tensors by GGUF name (rope_freqs)."""
    from tests.engine_worker.kquant_factory import quantize

    writer = gguf.GGUFWriter(str(out), arch)
    for name, w in state.items():
        w = np.asarray(w, dtype=np.float32)
        if arch == "llama" and ".q_proj." in name:
            w = _permute(w, heads)
        elif arch == "llama" and ".k_proj." in name:
            w = _permute(w, kv_heads)
        if w.ndim == 1:
            writer.add_tensor(_gguf_name(name), w)
            continue
        qtype = qtype_of(name)
        writer.add_tensor(_gguf_name(name), quantize(w, qtype), raw_dtype=qtype)
    for name, w in (extra or {}).items():
        writer.add_tensor(name, np.asarray(w, dtype=np.float32))
    return finish(writer, out)


def served_state(state: dict[str, np.ndarray],
                 qtype_of: Callable[[str], gguf.GGMLQuantizationType]) -> dict[str, torch.Tensor]:
    """The float32 weights a `write_state_gguf` file is served as: each 2-D weight quantized,
    rewritten to its kernel format (engine_worker/model/ggml_types.py) and read back."""
    from engine_worker.model.ggml_types import Blocks, convert
    from tests.engine_worker.kquant_factory import quantize

    out = {}
    for name, w in state.items():
        w = np.asarray(w, dtype=np.float32)
        if w.ndim == 2:
            qtype = qtype_of(name)
            got = convert(qtype, quantize(w, qtype), *w.shape)
            assert got is not None, qtype
            w = Blocks(got[0], got[1], *w.shape).floats()
        out[name] = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
    return out


def write_gguf(folder: Path, out: Path, layer_type: gguf.GGMLQuantizationType,
               embed_type: gguf.GGMLQuantizationType, heads: int | None = None,
               kv_heads: int | None = None) -> Path:
    """folder's model.safetensors -> out (a GGUF with only tensors and the architecture);
    heads and kv_heads: the folder's config's unless given."""
    if heads is None or kv_heads is None:
        from engine_worker.model.loader import load_config

        cfg = load_config(folder)
        heads, kv_heads = cfg.num_heads, cfg.num_kv_heads
    state = load_file(str(folder / "model.safetensors"))
    writer = gguf.GGUFWriter(str(out), "llama")
    for name, t in state.items():
        w = t.float().numpy()
        if name.endswith("q_proj.weight"):
            w = _permute(w, heads)
        elif name.endswith("k_proj.weight"):
            w = _permute(w, kv_heads)
        if w.ndim == 1:
            writer.add_tensor(_gguf_name(name), w.astype(np.float32))
            continue
        qtype = embed_type if "embed_tokens" in name else layer_type
        writer.add_tensor(_gguf_name(name), gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    return finish(writer, out)


def reference_state(folder: Path, layer_type: gguf.GGMLQuantizationType,
                    embed_type: gguf.GGMLQuantizationType) -> dict[str, torch.Tensor]:
    """HF-named float32 weights after gguf's quantize -> dequantize (row order is irrelevant:
    every block lies within one row, so the permutation commutes with it)."""
    out = {}
    for name, t in load_file(str(folder / "model.safetensors")).items():
        w = t.float().numpy()
        if w.ndim == 2:
            qtype = embed_type if "embed_tokens" in name else layer_type
            w = gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype).reshape(w.shape)
        out[name] = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
    return out
