"""A tiny random-weight Llama checkpoint for fast tests, with SmolLM2's real tokenizer.

Data flow: LlamaConfig (vocab 49152, a few small layers) -> transformers' LlamaForCausalLM built
under torch.manual_seed(seed) -> save_pretrained (config.json, model.safetensors) in `path`;
tokenizer files copied from a converted SmolLM2 folder, or else extracted from the embedded GGUF
(tokenizer only: no weights are read, so it takes seconds). The same seed gives the same weights.
Built by transformers on purpose: tests compare our forward to transformers' on this folder.

    python -m engine_worker.model.tiny PATH [--seed N] [--layers N]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from engine_worker.model.loader import TOKENIZER_FILES, embedded_gguf_path, save_gguf_tokenizer

SMOLLM2_VOCAB = 49152


def make_tiny_checkpoint(
    path: Path,
    *,
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 2048,
    tokenizer_from: Path | None = None,
    tie_word_embeddings: bool = True,
    initializer_range: float = 0.1,
) -> Path:
    """Write a tiny Llama checkpoint folder at `path` and return it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=SMOLLM2_VOCAB,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=tie_word_embeddings,
        # Wider than the usual 0.02 so logits are spread out: near-ties would make argmax
        # comparisons between dtypes a coin toss.
        initializer_range=initializer_range,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    with torch.random.fork_rng(devices=[]):  # do not disturb the caller's RNG
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(path)

    if tokenizer_from is not None:
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_from) / name).is_file():
                shutil.copy2(Path(tokenizer_from) / name, path / name)
    else:
        save_gguf_tokenizer(embedded_gguf_path(), path)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False,
                                     description="Write a tiny random-weight Llama checkpoint.")
    parser.add_argument("path", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokenizer-from", type=Path, default=None)
    args = parser.parse_args(argv)
    out = make_tiny_checkpoint(
        args.path, seed=args.seed, num_layers=args.layers, tokenizer_from=args.tokenizer_from
    )
    print(out)


if __name__ == "__main__":
    main()
