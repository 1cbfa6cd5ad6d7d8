"""A compiled decode step: torch.compile of the model's forward for a batch of one-token decodes.

Data flow of `CompiledDecode.run(items)` (every item one token, no `all_logits`):

    StepItems -> bucket (Bp, nblk_p): batch padded up to a power of two (<= max_num_seqs), block
      tables padded up to a power-of-two block count (<= the longest a sequence may have)
      -> one int64 buffer [ids | positions | slots | block tables | context lengths], fixed
         layout per bucket, one host-to-device copy
      -> the bucket's compiled graph: mask (Bp, 1, 1, T) from the context lengths -> the
         model's own forward (embed -> layers -> norm -> head) over AttnMeta, K/V written in place
      -> logits (Bp, V) float32, the first B rows returned

Padding invariants: a padded row has token 0 at position 0, writes its K/V to the scratch block
(the KV cache's last block, which the block manager never hands out) and attends only to that
slot (context length 1, so no row is fully masked and no NaN is made); a real row's table is
padded with the scratch block, whose columns the mask hides. Real rows therefore compute exactly
what the eager path computes for them.

Why compile: an eager SmolLM2 decode step is ~540 torch ops, each paying Python and dispatcher
time between short kernels; the compiled graph fuses the elementwise ops (RoPE, residuals,
SwiGLU, casts around the packed kernels) and calls the rest (packed INT4/INT8 matmuls, SDPA, a
registered custom attention op) as extern kernels from generated code. Each bucket is one static
graph, so the number of graphs is bounded by the buckets; Inductor's on-disk caches live under
the KESTREL cache dir, so a second start loads them instead of compiling.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine_worker.model.llama import AttnMeta

if TYPE_CHECKING:
    from engine_worker.model_runner import ModelRunner, StepItem

log = logging.getLogger("kestrel.compile")

COMPILE_MODES = ("off", "decode")


def pow2_at_least(n: int, cap: int) -> int:
    """The smallest power of two >= n, but at most cap (cap itself when n is above the last
    power of two below it)."""
    p = 1
    while p < n:
        p *= 2
    return min(p, cap)


def set_cache_dir(cache_dir: Path) -> Path:
    """Point Inductor's on-disk caches (FX graph, AOTAutograd, generated C++) at cache_dir/
    inductor, before anything compiles. Environment, because Inductor reads it there per
    call; setdefault keeps an explicit TORCHINDUCTOR_CACHE_DIR."""
    folder = Path(cache_dir) / "inductor"
    folder.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(folder))
    return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])


def compiler_available() -> bool:
    """Inductor's CPU backend builds C++: is a compiler there?"""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        return bool(get_cpp_compiler())
    except Exception:  # no compiler found, or an Inductor without that helper
        return False


class CompiledDecode:
    """Bucketed compiled decode graphs over one runner's model and KV cache."""

    def __init__(self, runner: ModelRunner, max_num_seqs: int, cache_dir: Path,
                 options: dict[str, object] | None = None) -> None:
        self.runner = runner
        self.bs = runner.block_size
        self.scratch = runner.scratch_block  # block id never handed out: padded rows write here
        self.max_batch = pow2_at_least(max_num_seqs, 1 << 30)
        self.max_nblk = -(-runner.max_model_len // self.bs)
        self.cache = set_cache_dir(cache_dir)
        # Measured (issue 10): cpp_wrapper cut no time per step here; freezing folds weights
        # as constants, which would copy the packed INT4 layouts into the graph. Both off.
        self.options = dict(options or {})
        self._fn = torch.compile(self._forward, dynamic=False, fullgraph=True,
                                 options=self.options or None)
        # every bucket is its own graph: let dynamo keep all of them
        n = len(self.batch_buckets()) * len(self.ctx_buckets())
        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(limit, n + 8)
        self.compiled: set[tuple[int, int]] = set()

    def batch_buckets(self) -> list[int]:
        out, b = [], 1
        while b < self.max_batch:
            out.append(b)
            b *= 2
        return [*out, self.max_batch]

    def ctx_buckets(self) -> list[int]:
        out, n = [], 1
        while n < self.max_nblk:
            out.append(n)
            n *= 2
        return [*out, self.max_nblk]

    def bucket(self, b: int, nblk: int) -> tuple[int, int]:
        return pow2_at_least(b, self.max_batch), pow2_at_least(nblk, self.max_nblk)

    def supports(self, items: list[StepItem]) -> bool:
        """One-token decodes only (prefill chunks and verification stay eager), within buckets."""
        return (0 < len(items) <= self.max_batch
                and all(len(it.token_ids) == 1 and not it.all_logits for it in items))

    def _forward(self, packed: torch.Tensor, bp: int, nblk: int) -> torch.Tensor:
        """packed: (4 * Bp + Bp * nblk,) int64, see `run`. Returns logits (Bp, V) float32."""
        t = nblk * self.bs
        ids, pos, slots, ctx, blocks = packed.split([bp, bp, bp, bp, bp * nblk])
        col = torch.arange(t, device=packed.device)  # (T,)
        mask = (col[None, :] < ctx[:, None]).view(bp, 1, 1, t)  # (Bp, 1, 1, T)
        meta = AttnMeta(slot_mapping=slots, block_size=self.bs, num_decode=bp,
                        decode_blocks=blocks, decode_ctx=t, decode_mask=mask)
        return self.runner.model(ids, pos, meta, self.runner.kv_cache, None)  # (Bp, V)

    def pack(self, items: list[StepItem]) -> tuple[torch.Tensor, int, int]:
        """The bucket's int64 buffer for items: pads rows and block tables (module docstring)."""
        bs, sc = self.bs, self.scratch
        b = len(items)
        ctx = [it.start_pos + 1 for it in items]
        bp, nblk = self.bucket(b, -(-max(ctx) // bs))
        pad = bp - b
        ids = [it.token_ids[0] for it in items] + [0] * pad
        pos = [it.start_pos for it in items] + [0] * pad
        slots = [it.block_table[p // bs] * bs + p % bs
                 for it, p in zip(items, pos[:b], strict=True)]
        slots += [sc * bs] * pad
        blocks: list[int] = []
        for it, c in zip(items, ctx, strict=True):
            used = it.block_table[: -(-c // bs)]
            blocks += used + [sc] * (nblk - len(used))
        blocks += [sc] * (nblk * pad)
        packed = torch.tensor(ids + pos + slots + ctx + [1] * pad + blocks, dtype=torch.int64)
        return packed.to(self.runner.device, non_blocking=True), bp, nblk

    def run(self, items: list[StepItem]) -> torch.Tensor:
        """logits (B, V) float32 for one-token decodes (`supports(items)` must hold)."""
        for it in items:
            self.runner._check(it)
        packed, bp, nblk = self.pack(items)
        if (bp, nblk) not in self.compiled:
            self._note_compile(bp, nblk, lambda: self._fn(packed, bp, nblk))
        return self._fn(packed, bp, nblk)[: len(items)]

    def _note_compile(self, bp: int, nblk: int, call: Callable[[], object]) -> None:
        t0 = time.monotonic()
        call()
        self.compiled.add((bp, nblk))
        log.info("compiled decode graph: batch %d, context %d tokens (%.1f s)",
                 bp, nblk * self.bs, time.monotonic() - t0)

    @torch.inference_mode()
    def warm(self, buckets: Iterable[tuple[int, int]]) -> float:
        """Compile (or load from the on-disk cache) the given (batch, blocks) buckets now,
        logging one line per bucket. Writes only the scratch block. Returns seconds taken."""
        t0 = time.monotonic()
        todo = [bk for bk in buckets if bk not in self.compiled]
        for i, (bp, nblk) in enumerate(todo):
            sc = self.scratch
            packed = torch.tensor([0] * bp + [0] * bp + [sc * self.bs] * bp + [1] * bp
                                  + [sc] * (bp * nblk), dtype=torch.int64)
            packed = packed.to(self.runner.device)
            log.info("compiling decode graph %d/%d", i + 1, len(todo))
            self._note_compile(bp, nblk, lambda p=packed, b=bp, n=nblk: self._fn(p, b, n))
        return time.monotonic() - t0
