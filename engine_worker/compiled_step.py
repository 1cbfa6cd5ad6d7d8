"""A compiled decode step: torch.compile of the model's forward for a batch of one-token decodes.

Data flow of `CompiledDecode.run(items)` (every item one token, no `all_logits`):

    StepItems -> bucket (Bp, nblk_p): batch padded up to the next batch bucket (powers of two
      up to max_num_seqs rounded up, plus a GGUF layer's kernel switch edge), block tables
      padded up to a power-of-two block count (>= MIN_CONTEXT tokens, <= max_model_len)
      -> one int64 buffer [ids | positions | slots | context lengths | block tables], fixed
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
import types
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from engine_worker.kv_cache import KVCache
from engine_worker.model.attention import AttnMeta
from engine_worker.step import StepItem

log = logging.getLogger("kestrel.compile")

MIN_CONTEXT = 256  # tokens: the smallest context bucket


def pow2_at_least(n: int, cap: int) -> int:
    """The smallest power of two >= n, but at most cap (cap itself when n is above the last
    power of two below it)."""
    p = 1
    while p < n:
        p *= 2
    return min(p, cap)


def _own_code(method: Callable[..., torch.Tensor], tag: int) -> Callable[..., torch.Tensor]:
    """`method` bound to its object again, over a copy of its code object. Dynamo keeps its
    graphs and guards per code object; without guards on the modules (see CompiledDecode),
    two instances sharing `_forward`'s code (a test's eager/compiled pair of runners, two
    models in one process) would run each other's graphs."""
    fn = method.__func__  # type: ignore[attr-defined]
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{tag:x}")
    copy = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__,
                              fn.__closure__)
    return types.MethodType(copy, method.__self__)  # type: ignore[attr-defined]


def set_cache_dir(cache_dir: Path) -> Path:
    """Point Inductor's on-disk caches (FX graph, AOTAutograd, built C++) at cache_dir/inductor
    before anything compiles. Through the environment, which Inductor reads on every lookup;
    unconditionally, because Inductor writes its /tmp default there itself on its first
    lookup (a torch import may already have made one), so a value present says nothing."""
    folder = Path(cache_dir).resolve() / "inductor"
    folder.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    return folder


def compiler_available() -> bool:
    """Inductor's CPU backend builds C++: is a compiler there?"""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        return bool(get_cpp_compiler())
    except Exception:  # no compiler found, or an Inductor without that helper
        return False


class StepRunner(Protocol):
    """What a compiled step reads of its runner (engine_worker/model_runner.py)."""

    model: nn.Module
    kv_cache: KVCache
    device: torch.device
    block_size: int
    max_model_len: int
    scratch_block: int
    paged_decode: bool  # decodes read the cache in place (the paged kernel)

    def check(self, item: StepItem) -> None: ...


class CompiledDecode:
    """Bucketed compiled decode graphs over one runner's model and KV cache."""

    def __init__(self, runner: StepRunner, max_num_seqs: int, cache_dir: Path,
                 options: dict[str, object] | None = None,
                 switch_rows: tuple[int, ...] = ()) -> None:
        """switch_rows: the row counts at which some layer changes path (the matmul plan's,
        model/matmul_plan.py). Each is made a batch bucket edge: a batch below one is never
        padded up to it, so a padded step runs the same kernels as the eager one."""
        self.runner = runner
        self.bs = runner.block_size
        self.scratch = runner.scratch_block  # block id never handed out: padded rows write here
        self.max_batch = pow2_at_least(max_num_seqs, 1 << 30)
        self.switch_rows = switch_rows
        self.max_nblk = -(-runner.max_model_len // self.bs)
        # Contexts below MIN_CONTEXT tokens share one bucket: attention over a few hundred
        # masked columns costs little, a graph per small size costs a compile each.
        self.min_nblk = max(1, MIN_CONTEXT // self.bs)
        self.cache = set_cache_dir(cache_dir)
        # Measured (issue 10, SmolLM2 GGUF-native, batch 1, 1 thread): dynamo's guards on
        # every module attribute cost ~1 ms a call, ~0.12 ms without them; the modules never
        # change after loading, so only guards on the inputs (tensors, bucket ints) are kept.
        # Inductor's cpp_wrapper gained ~1 ms a step more but doubled the first compile
        # (92 s against 45 s a bucket), so it is left to `options`.
        self.options: dict[str, object] = {
            "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
            **(options or {}),
        }
        self._fn = torch.compile(_own_code(self._forward, id(self)), dynamic=False,
                                 fullgraph=True, options=self.options)
        # every bucket is its own graph: let dynamo keep all of them
        n = len(self.batch_buckets()) * len(self.ctx_buckets())
        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(limit, n + 8)
        self.compiled: set[tuple[int, int]] = set()

    def batch_buckets(self) -> list[int]:
        out, b = {self.max_batch}, 1
        while b < self.max_batch:
            out.add(b)
            b *= 2
        out.update(r - 1 for r in self.switch_rows if 1 < r <= self.max_batch)
        return sorted(out)

    def ctx_buckets(self) -> list[int]:
        out, n = [], min(self.min_nblk, self.max_nblk)
        while n < self.max_nblk:
            out.append(n)
            n *= 2
        return [*out, self.max_nblk]

    def bucket(self, b: int, nblk: int) -> tuple[int, int]:
        return (next(x for x in self.batch_buckets() if x >= b),
                pow2_at_least(max(nblk, self.min_nblk), self.max_nblk))

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
        # the table and lengths let Attention read the cache in place (the paged kernel, a
        # registered op with a fake implementation, compiles as an extern call); without the
        # kernel it gathers the padded blocks and masks by `mask`
        meta = AttnMeta(slot_mapping=slots, block_size=self.bs, num_decode=bp,
                        decode_blocks=blocks, decode_ctx=t, decode_mask=mask,
                        decode_table=blocks.view(bp, nblk), decode_lens=ctx,
                        paged=self.runner.paged_decode)
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
            self.runner.check(it)
        packed, bp, nblk = self.pack(items)
        if (bp, nblk) not in self.compiled:
            self._note_compile(bp, nblk, lambda: self._fn(packed, bp, nblk))
        return self._fn(packed, bp, nblk)[: len(items)]

    def _note_compile(self, bp: int, nblk: int, call: Callable[[], object]) -> None:
        """Run the bucket's first call (a compile, or a load from the on-disk cache), logged."""
        log.info("compiling decode graph: batch %d, context %d tokens (%d of %d buckets)",
                 bp, nblk * self.bs, len(self.compiled) + 1,
                 len(self.batch_buckets()) * len(self.ctx_buckets()))
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
        for bp, nblk in todo:
            sc = self.scratch
            packed = torch.tensor([0] * bp + [0] * bp + [sc * self.bs] * bp + [1] * bp
                                  + [sc] * (bp * nblk), dtype=torch.int64)
            packed = packed.to(self.runner.device)
            self._note_compile(bp, nblk, lambda p=packed, b=bp, n=nblk: self._fn(p, b, n))
        return time.monotonic() - t0
