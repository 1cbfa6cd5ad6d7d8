"""The paged KV cache: pre-allocated K and V tensors per layer, written in place.

Layout per layer: `k[layer]` and `v[layer]` are (Hkv, num_blocks * block_size, D): each KV head's
rows lie in their own run, in slot order, so decode attention reads a head's context as one
stream where its blocks are consecutive (with a slot's heads side by side it read every other
256 bytes, at a third of the read bandwidth; csrc/paged_attention.cpp). A token's slot is
`block * block_size + offset`; the model writes a step's new K/V at its slots (`write`) and reads
a sequence back by gathering the blocks in its block table (`gather`), or (CPU decodes) reads
them in place through the table (engine_worker/paged_attention.py). Which blocks belong to
which sequence is the block manager's business (no torch there); this module only owns the
memory and says how much a budget buys.

The cache's dtype is its own (bfloat16 by default on a CPU, whatever the activations): a decode
step reads every token of its context, so the cache's bytes per token are read at every step.
The 8-bit caches (--kv-cache-dtype int8 or fp8) carry their scales in the row: a (slot, head) row
is D one-byte codes, then one float16 scale per group of 32 along D (one group when D is not a
multiple of 32) in its last bytes, as llama.cpp's q8_0 blocks are: (Hkv, slots, D + 2 * groups)
of torch.int8 or torch.float8_e4m3fn. A group's scale is its largest magnitude over 127 (int8,
codes rounded to nearest) or over 448 (fp8 e4m3, the format's largest finite value); `encode`
and `decode` here are the Python layers' writers and readers, and the C++ decode stack and
paged attention kernel write and read the same bits (csrc/decode_stack.cpp, paged_attention.cpp).
On a CPU the tensors lie in anonymous mappings: the kernel hands them out zeroed and a page
becomes the process's only when first written, so a budget sized for whole contexts costs the
host what is used, not what is reserved (torch.zeros would write every page at start).
"""

from __future__ import annotations

import math
import mmap

import torch

from engine_worker.model.config import ModelConfig

# --kv-cache-dtype names of the 8-bit caches: the codes' dtype and the largest code
SCALED = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
TOP = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}  # a code dtype's largest code
GROUP = 32  # values per scale along D


def kv_torch_dtype(name: str) -> torch.dtype:
    """The cache tensors' dtype for a --kv-cache-dtype name (auto resolved already)."""
    return SCALED.get(name) or getattr(torch, name)


def is_scaled(dtype: torch.dtype) -> bool:
    """Whether a cache of this dtype holds codes and per-group scales (the 8-bit caches)."""
    return dtype in TOP


def scale_groups(d: int) -> int:
    """Scales per row of head size d: one per 32 values, or one for the row."""
    return d // GROUP if d % GROUP == 0 else 1


def row_width(d: int, dtype: torch.dtype) -> int:
    """Elements of one (slot, head) row: d, or d codes and their float16 scales' bytes."""
    if not is_scaled(dtype):
        return d
    if d % 2:
        raise ValueError(f"an 8-bit KV cache needs an even head size, not {d}")
    return d + 2 * scale_groups(d)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def kv_cache_bytes(cfg: ModelConfig, num_tokens: int, dtype: torch.dtype) -> int:
    """Bytes of K and V for `num_tokens` tokens over all layers."""
    per_token = (2 * cfg.num_layers * cfg.num_kv_heads * row_width(cfg.head_dim, dtype)
                 * _element_size(dtype))
    return per_token * num_tokens


def encode(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows (..., D) as the cache holds them: cast, or codes and scales (..., W)."""
    if not is_scaled(dtype):
        return x.to(dtype)
    *lead, d = x.shape
    ng = scale_groups(d)
    top = TOP[dtype]
    xf = x.float().unflatten(-1, (ng, d // ng))
    scale = (xf.abs().amax(-1, keepdim=True) / top).to(torch.float16)  # (..., ng, 1)
    q = xf / torch.where(scale == 0, 1.0, scale.float())  # an all-zero group: codes 0
    q = q.round().clamp(-top, top) if dtype == torch.int8 else q.clamp(-top, top)
    codes = q.to(dtype).view(torch.int8).flatten(-2)  # (..., D)
    scales = scale.flatten(-2).view(torch.int8)  # (..., 2 * ng) bytes
    return torch.cat([codes, scales], dim=-1).view(dtype)


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """An 8-bit cache viewed as int8 (torch's CPU index_copy_ and index_select have no fp8),
    any other as it is."""
    return cache.view(torch.int8) if is_scaled(cache.dtype) else cache


def write(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """Rows x (N, Hkv, D) into the cache (Hkv, slots, W) at `slots`, as the cache holds them."""
    as_bytes(cache).index_copy_(1, slots, as_bytes(encode(x, cache.dtype)).transpose(0, 1))


def head_major(rows: torch.Tensor) -> torch.Tensor:
    """Slot-ordered rows (slots, Hkv, W) in the cache's layout (Hkv, slots, W)."""
    return rows.transpose(0, 1).contiguous()


def gather(cache: torch.Tensor, blocks: torch.Tensor | int, b: int, t: int,
           block_size: int) -> torch.Tensor:
    """The first t positions of b sequences, (B, Hkv, T, W) in the cache's dtype: `blocks` their
    block tables flattened (B * nblk ids), or one sequence's first block id when its blocks are
    consecutive (then a view: no copy)."""
    hkv, slots, w = cache.shape
    if isinstance(blocks, int):
        return cache[:, blocks * block_size: blocks * block_size + t].unsqueeze(0)
    raw = as_bytes(cache)  # fp8 has no CPU index_select: its bytes are gathered as int8's
    paged = raw.view(hkv, slots // block_size, block_size, w)
    seq = paged.index_select(1, blocks).view(hkv, b, -1, w)[:, :, :t]  # (Hkv, B, T, W)
    return seq.transpose(0, 1).view(cache.dtype)


def decode(rows: torch.Tensor, d: int, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows (..., W) back to values (..., D) in `dtype`: a cast, or codes times scales."""
    if not is_scaled(rows.dtype):
        return rows.to(dtype)
    ng = scale_groups(d)
    raw = rows.view(torch.int8)
    codes = raw[..., :d].view(rows.dtype).float()
    scales = raw[..., d:].contiguous().view(torch.float16).float()  # (..., ng)
    vals = codes.unflatten(-1, (ng, d // ng)) * scales.unsqueeze(-1)
    return vals.flatten(-2).to(dtype)


def num_blocks_for_budget(
    cfg: ModelConfig, budget_bytes: int, block_size: int, dtype: torch.dtype
) -> int:
    """How many whole blocks fit in `budget_bytes` (0 if not even one does)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return max(0, budget_bytes // kv_cache_bytes(cfg, block_size, dtype))


class KVCache:
    """Every layer's K and V, allocated once: `k[l]`, `v[l]` are (Hkv, blocks * block_size, W)."""

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
        shape = (cfg.num_kv_heads, self.capacity_tokens, row_width(cfg.head_dim, dtype))
        # zeros, not empty: padded reads of unused slots are masked out, but must never be NaN,
        # since 0 * NaN inside a matmul would still poison the result.
        self._maps: list[mmap.mmap] = []  # the CPU tensors' memory, kept alive with them
        self.k = [self._zeros(shape, dtype) for _ in range(cfg.num_layers)]
        self.v = [self._zeros(shape, dtype) for _ in range(cfg.num_layers)]

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=dtype, device=self.device)
        size = math.prod(shape) * _element_size(dtype)
        buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # zero pages
        self._maps.append(buf)
        return torch.frombuffer(buf, dtype=dtype).view(shape)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k) + sum(t.nbytes for t in self.v)
