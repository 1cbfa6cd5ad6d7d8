"""The paged KV cache: pre-allocated K and V tensors per layer, written in place.

Layout per layer: `k[layer]` and `v[layer]` are (num_blocks * block_size, Hkv, D). A token's slot is
`block * block_size + offset`; the model writes a step's new K/V with `index_copy_` at its slots and
reads a sequence back by viewing the tensor as (num_blocks, block_size, Hkv, D) and gathering the
blocks in its block table, or (CPU decodes) reads the slots in place through the table
(engine_worker/paged_attention.py). Which blocks belong to which sequence is the block
manager's business (no torch there); this module only owns the memory and says how much a
budget buys.

The cache's dtype is its own (bfloat16 by default on a CPU, whatever the activations): a decode
step reads every token of its context, so the cache's bytes per token are read at every step.
On a CPU the tensors lie in anonymous mappings: the kernel hands them out zeroed and a page
becomes the process's only when first written, so a budget sized for whole contexts costs the
host what is used, not what is reserved (torch.zeros would write every page at start).
"""

from __future__ import annotations

import mmap

import torch

from engine_worker.model.config import ModelConfig


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def kv_cache_bytes(cfg: ModelConfig, num_tokens: int, dtype: torch.dtype) -> int:
    """Bytes of K and V for `num_tokens` tokens over all layers."""
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * _element_size(dtype)
    return per_token * num_tokens


def num_blocks_for_budget(
    cfg: ModelConfig, budget_bytes: int, block_size: int, dtype: torch.dtype
) -> int:
    """How many whole blocks fit in `budget_bytes` (0 if not even one does)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return max(0, budget_bytes // kv_cache_bytes(cfg, block_size, dtype))


class KVCache:
    """Every layer's K and V, allocated once: `k[l]`, `v[l]` are (blocks * block_size, Hkv, D)."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: str | torch.device,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"need num_blocks > 0 and block_size > 0, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.capacity_tokens = num_blocks * block_size
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (self.capacity_tokens, cfg.num_kv_heads, cfg.head_dim)
        # zeros, not empty: padded reads of unused slots are masked out, but must never be NaN,
        # since 0 * NaN inside a matmul would still poison the result.
        self._maps: list[mmap.mmap] = []  # the CPU tensors' memory, kept alive with them
        self.k = [self._zeros(shape, dtype) for _ in range(cfg.num_layers)]
        self.v = [self._zeros(shape, dtype) for _ in range(cfg.num_layers)]

    def _zeros(self, shape: tuple[int, int, int], dtype: torch.dtype) -> torch.Tensor:
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=dtype, device=self.device)
        size = shape[0] * shape[1] * shape[2] * _element_size(dtype)
        buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # zero pages
        self._maps.append(buf)
        return torch.frombuffer(buf, dtype=dtype).view(shape)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k) + sum(t.nbytes for t in self.v)
