"""The model runner: turns one scheduled step into one forward pass and returns its logits.

Data flow of `execute(items)`:

    StepItems (token ids, start position, block table of each sequence)
      -> _prepare: decodes first, then prefill chunks, laid out as one flat batch; every index
         (ids, positions, slots, decode block lists, context lengths, rows to score) packed into
         one int64 buffer and moved to the device in one copy, then sliced
      -> LlamaForCausalLM.forward (writes K/V into the KVCache in place, reads earlier tokens)
      -> float32 logits (R, V): one row per item (its last token), or one row per token for an
         item with `all_logits` (speculative verification scores every draft), in item order

The runner owns the weights and the KV cache memory; which blocks a sequence owns is decided
outside (block manager), and arrives here as block tables.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from engine_worker.compiled_step import CompiledDecode
from engine_worker.kv_cache import KVCache, kv_cache_bytes, kv_torch_dtype, num_blocks_for_budget
from engine_worker.model import decode_stack
from engine_worker.model.attention import AttnMeta, PrefillSpan
from engine_worker.model.builder import build_model
from engine_worker.model.loader import load_config
from engine_worker.model.quant import decode_read_bytes, weight_bytes
from engine_worker.paged_attention import load_paged_attention
from engine_worker.runner_config import RunnerConfig, resolve_kv_dtype
from engine_worker.step import StepItem
from engine_worker.thread_choice import ThreadChoice

_log = logging.getLogger("kestrel.model")


class ModelRunner:
    def __init__(self, cfg: RunnerConfig) -> None:
        """The model, its KV cache and the decode paths `cfg` names (engine_worker/
        runner_config.py; the worker builds it with RunnerConfig.from_worker)."""
        if cfg.num_threads is not None:
            # Process-wide by nature; torch's default (one per physical core) is usually right.
            torch.set_num_threads(cfg.num_threads)
        self.runner_config = cfg
        self.device = torch.device(cfg.device)
        self.dtype = getattr(torch, cfg.dtype)
        self.dtype_name = cfg.dtype
        self.kv_dtype_name = resolve_kv_dtype(cfg.kv_cache_dtype, cfg.dtype, cfg.device)
        self.kv_dtype = kv_torch_dtype(self.kv_dtype_name)
        block_size, budget = cfg.block_size, cfg.kv_budget_bytes
        model_cfg = load_config(Path(cfg.model_path))
        cache_blocks = num_blocks_for_budget(model_cfg, budget, block_size, self.kv_dtype)
        # Compiled decodes pad their batch with rows that write K/V somewhere: the cache's last
        # block, kept out of the ids the block manager hands out (0..num_blocks-1).
        num_blocks = cache_blocks - (cfg.compile_mode == "decode")
        if num_blocks <= 0:
            need = "one block" if cfg.compile_mode == "off" else "two blocks (one for padding)"
            raise ValueError(f"KV budget of {budget} bytes is less than {need}")
        limit = min(model_cfg.max_position_embeddings, num_blocks * block_size)
        if model_cfg.sliding_window is not None:
            limit = min(limit, model_cfg.sliding_window)  # full attention is exact only within it
        max_model_len = limit if cfg.max_model_len is None else cfg.max_model_len
        if not 0 < max_model_len <= limit:
            raise ValueError(
                f"max_model_len {max_model_len} must be in 1..{limit} (checkpoint context "
                f"{model_cfg.max_position_embeddings}, KV capacity {num_blocks * block_size} "
                "tokens)"
            )
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.paged_attention = load_paged_attention(cfg.paged_attention, self.device,
                                                    self.dtype, cfg.cache_dir, self.kv_dtype)
        built = build_model(cfg, model_cfg, max_model_len, paged=self.paged_attention.enabled)
        self.model, self.quant, self.paths = built.model, built.quant, built.paths
        self.plan = built.plan  # which kernel every matmul runs (model/matmul_plan.py)
        self.config = self.model.config
        # the C++ decode stack, where the plan has one (paged, float32 decodes on CPU)
        self.decode_stack = decode_stack.build(self.model, self.plan)
        # The runner's own switches (tests compare the paths); the modules never change.
        self.paged_decode = self.paged_attention.enabled
        self.use_stack = self.decode_stack is not None
        # short prompt chunks beside decodes through the stack as decode rows (a switch the
        # tests and benchmarks/bench_mixed_step.py turn off to compare)
        self.prompts_through_stack = True
        # --threads 0 on a stack-served model: the count is measured while serving
        self.thread_choice = (ThreadChoice(torch.get_num_threads())
                              if cfg.adapt_threads and self.plan.decode_stack
                              and torch.get_num_threads() > 1 else None)
        self.scratch_block = num_blocks  # == cache_blocks - 1 when compiled; unused otherwise
        self.kv_cache = KVCache(self.config, cache_blocks, block_size, self.kv_dtype, self.device)
        self.compiled: CompiledDecode | None = None
        if cfg.compile_mode == "decode":
            self.compiled = CompiledDecode(self, cfg.max_num_seqs, cfg.cache_dir,
                                           switch_rows=self.plan.switch_rows())
        # parameters and quantized buffers; a tied embedding (shared tensor) counted once
        self.weight_bytes = weight_bytes(self.model)
        # what a one-row decode step reads: these weights, and the context's K and V
        self.decode_read_bytes = decode_read_bytes(self.model)
        self.kv_bytes_per_token = kv_cache_bytes(self.config, 1, self.kv_dtype)
        _log.info("a decode step reads %.1f MB of weights a token, and %.1f KiB of %s K/V a "
                  "token of its context; the KV cache holds %d tokens (%d blocks of %d) in "
                  "%.2f GiB (%s); context %d tokens (the checkpoint's %d)",
                  self.decode_read_bytes / 1e6, self.kv_bytes_per_token / 1024,
                  self.kv_dtype_name, self.num_blocks * block_size, self.num_blocks,
                  block_size, self.kv_cache.nbytes / 2**30,
                  cfg.kv_budget_why or f"{budget} bytes", self.max_model_len,
                  model_cfg.max_position_embeddings)

    def set_paged_attention(self, on: bool) -> None:
        """Decodes read the cache in place (True; needs the kernel loaded) or gather a copy."""
        if on and not self.paged_attention.enabled:
            raise ValueError(f"paged attention kernel unavailable: {self.paged_attention.reason}")
        self.paged_decode = on
        self.set_decode_stack(on and self.decode_stack is not None)

    def set_decode_stack(self, on: bool) -> None:
        """Decode rows through the C++ stack (True; it must have been built) or the Python
        layers (model/decode_stack.py; the stack reads the cache in place, so paged only)."""
        if on and (self.decode_stack is None or not self.paged_decode):
            raise ValueError("the decode stack serves this runner only with paged attention, "
                             "and only where it was built")
        self.use_stack = on

    @torch.inference_mode()
    def execute(self, items: list[StepItem], compiled: bool = True) -> torch.Tensor:
        """float32 logits (R, V), one forward pass: a row for the last token of each item, or
        rows for all its tokens when `item.all_logits`, in item order. `compiled=False`: the
        eager path even where a compiled decode serves (a probe must not compile a graph)."""
        if not items:
            raise ValueError("execute needs at least one item")
        if compiled and self.compiled is not None and self.compiled.supports(items):
            return self.compiled.run(items)  # (B, V): same rows as the eager path
        as_rows = self._prompts_as_decodes(items)
        ids, positions, meta, rows = self._prepare(items, as_rows)
        stack = self.decode_stack if self.use_stack else None
        choice = self.thread_choice if stack is not None else None
        if stack is not None and meta.num_decode < ids.shape[0] and self._one_kernel(ids.shape[0]):
            # A mixed step whose rows all take the integer-dot kernel: decode and prompt rows
            # meet in the same matmuls, one pass over the weights (the stack beside the prompt's
            # layers read them twice: on the 1.5B Qwen, 16 prompt rows beside a decoder added
            # 90 ms to its step so, 48 ms in one pass, Zen 5), with the same bits, since a row's
            # result does not depend on the other rows' in that kernel. (Short prompt chunks
            # go through the stack as decode rows instead: _prompts_as_decodes.)
            stack = None
        if choice is None:
            return self.model(ids, positions, meta, self.kv_cache, rows, stack=stack)
        choice.threads()
        t0 = time.perf_counter()
        logits = self.model(ids, positions, meta, self.kv_cache, rows, stack=stack)
        if meta.num_decode == ids.shape[0] and not as_rows:
            # decode-only steps are the ones compared (not prompt chunks run as decode rows)
            choice.record(meta.num_decode, time.perf_counter() - t0)
        return logits

    def _prompts_as_decodes(self, items: list[StepItem]) -> set[int]:
        """The prompt chunks of this step (their indices) that run as decode rows, one row a
        token reading its own prefix from the cache (as verification rows do): through the C++
        stack with the step's decodes, one pass without the Python layers' ~25 torch calls a
        layer. A short chunk whose rows take the integer-dot kernel (the same matmuls, the same
        bits a row) and whose rows x context are few: the in-place kernel reads a row's whole
        context for each of its rows, where the chunk's SDPA reads it once. The choice is the
        chunk's own, whatever runs beside it, so a prompt's numbers do not depend on its batch
        (tests/e2e/test_batch_invariance.py)."""
        if not (self.use_stack and self.prompts_through_stack):
            return set()
        return {i for i, it in enumerate(items)
                if len(it.token_ids) > 1 and not _verify_as_decodes(it)
                and self._one_kernel(len(it.token_ids))
                and len(it.token_ids) * (it.start_pos + len(it.token_ids))
                <= PROMPT_AS_DECODES_READS}

    @property
    def mixed_steps_one_pass(self) -> bool:
        """Whether a step's prompt rows always meet its decode rows in the same matmuls, one
        pass over the weights: no stack beside the layers, or every row count on the
        integer-dot kernel. Where not, a prompt chunk beside the stack pays a pass of its own."""
        return not self.use_stack or self.plan.int_dot_all

    def _one_kernel(self, rows: int) -> bool:
        """Whether every layer runs a step of `rows` rows through the integer-dot kernel."""
        return self.plan.int_dot_all or rows <= self.plan.int_dot_rows

    @torch.inference_mode()
    def forward_full(self, token_ids: list[int]) -> torch.Tensor:
        """float32 logits (T, V) at every position, recomputed from scratch: no cache is read or
        written. A reference for tests, and a cache-free scorer."""
        t = len(token_ids)
        if not 0 < t <= self.max_model_len:
            raise ValueError(f"need 1..{self.max_model_len} tokens, got {t}")
        ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)  # (T,)
        positions = torch.arange(t, device=self.device)  # (T,)
        meta = AttnMeta(slot_mapping=None, prefills=[PrefillSpan(begin=0, length=t, start_pos=0)])
        return self.model(ids, positions, meta, None, None)

    @torch.inference_mode()
    def embed(self, inputs: list[list[int]], pooling: str) -> torch.Tensor:
        """float32 (k, C): each input's last hidden states (the final norm's output) pooled,
        "mean" over its tokens or "last" (its last token's), then L2-normalised. One forward
        over all of them, each a prefill span from position 0: no cache is read or written."""
        ids: list[int] = []
        spans: list[PrefillSpan] = []
        for tokens in inputs:
            if not 0 < len(tokens) <= self.max_model_len:
                raise ValueError(f"an input needs 1..{self.max_model_len} tokens, got "
                                 f"{len(tokens)}")
            spans.append(PrefillSpan(begin=len(ids), length=len(tokens), start_pos=0))
            ids += tokens
        positions = [p for s in spans for p in range(s.length)]
        packed = torch.tensor(ids + positions, dtype=torch.int64).to(self.device)
        ids_t, pos_t = packed.split([len(ids), len(ids)])
        meta = AttnMeta(slot_mapping=None, prefills=spans)
        states = self.model(ids_t, pos_t, meta, None, None, hidden=True)  # (R, C)
        if pooling == "last":
            pooled = states[[s.begin + s.length - 1 for s in spans]]
        elif pooling == "mean":
            pooled = torch.stack([states[s.begin : s.begin + s.length].mean(0) for s in spans])
        else:
            raise ValueError(f"unknown pooling {pooling!r} (mean or last)")
        return torch.nn.functional.normalize(pooled, dim=-1)

    def check(self, item: StepItem) -> None:
        """Raise ValueError unless `item` fits this runner's context and cache."""
        item.check(self.max_model_len, self.block_size, self.num_blocks)

    def _prepare(
        self, items: list[StepItem], prompts_as_decodes: set[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, AttnMeta, torch.Tensor]:
        bs = self.block_size
        for it in items:
            self.check(it)
        # Decodes first so that their rows are one contiguous slice [0, B) for one batched SDPA.
        # A verification item (a few tokens after a cached context, every row scored) runs as
        # one decode row per token, each attending to its own prefix: its logits are then
        # exactly those one-token decodes would give, so greedy speculation keeps the text of
        # decoding without it (a prefill-style pass sums the attention in another order, and a
        # near tie can flip). The chunks in `prompts_as_decodes` too (_prompts_as_decodes).
        as_rows = prompts_as_decodes or set()
        expanded = [(i, StepItem([t], it.start_pos + j, it.block_table))
                    for i, it in enumerate(items)
                    if len(it.token_ids) == 1 or _verify_as_decodes(it) or i in as_rows
                    for j, t in enumerate(it.token_ids)]
        as_decode = {i for i, _ in expanded}
        prefill_idx = [i for i in range(len(items)) if i not in as_decode]
        decodes = [d for _, d in expanded]
        prefills = [items[i] for i in prefill_idx]

        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        scored: list[list[int]] = [[] for _ in items]  # rows to score of each item
        for i, d in expanded:
            q = d.start_pos
            ids.append(d.token_ids[0])
            pos.append(q)
            slots.append(d.block_table[q // bs] * bs + q % bs)
            if items[i].all_logits or len(items[i].token_ids) == 1:
                scored[i].append(len(ids) - 1)
            else:  # a prompt chunk as decode rows: its last row is scored
                scored[i] = [len(ids) - 1]
        for i in prefill_idx:
            it = items[i]
            table, start = it.block_table, it.start_pos
            p = range(start, start + len(it.token_ids))
            ids += it.token_ids
            pos += p
            slots += [table[q // bs] * bs + q % bs for q in p]
            scored[i] = list(range(len(ids) - len(it.token_ids), len(ids))) if it.all_logits \
                else [len(ids) - 1]
        last_row = [r for rows in scored for r in rows]  # in the items' order

        b = len(decodes)
        ctx = [it.start_pos + 1 for it in decodes]  # context length of each decode
        t_max = max(ctx, default=0)
        nblk = -(-t_max // bs)
        dec_blocks: list[int] = []
        for it in decodes:  # pad each table to nblk with block 0: read, then masked out
            dec_blocks += (it.block_table[:nblk] + [0] * nblk)[:nblk]

        n = len(ids)
        packed = torch.tensor(
            ids + pos + slots + last_row + dec_blocks + ctx, dtype=torch.int64
        ).to(self.device, non_blocking=True)
        ids_t, pos_t, slots_t, rows_t, blocks_t, ctx_t = packed.split(
            [n, n, n, len(last_row), len(dec_blocks), b]
        )
        decode_where: torch.Tensor | int | None = blocks_t if b else None
        gather = b and not self.paged_decode  # the kernel reads only the table and lengths
        if gather and b == 1:  # a lone decode in consecutive blocks reads a view, no gather
            run = _run_start(decodes[0].block_table[:nblk])
            decode_where = blocks_t if run is None else run
        decode_mask = None
        if gather and min(ctx) != t_max:  # ragged contexts: mask each row past its length
            col = torch.arange(t_max, device=self.device)
            decode_mask = (col < ctx_t[:, None]).view(b, 1, 1, t_max)  # (B, 1, 1, T)

        spans: list[PrefillSpan] = []
        row = b
        for it in prefills:
            length, start = len(it.token_ids), it.start_pos
            span = PrefillSpan(begin=row, length=length, start_pos=start)
            if start > 0:  # earlier tokens are in the cache: gather them, mask causally
                s = start + length
                used = it.block_table[: -(-s // bs)]
                run = _run_start(used)
                span.blocks = torch.tensor(used, device=self.device) if run is None else run
                key = torch.arange(s, device=self.device)
                query = torch.arange(start, s, device=self.device)
                span.mask = key[None, :] <= query[:, None]  # (L, S)
            spans.append(span)
            row += length

        meta = AttnMeta(
            slot_mapping=slots_t,
            block_size=bs,
            num_decode=b,
            decode_blocks=decode_where,
            decode_ctx=t_max,
            decode_mask=decode_mask,
            decode_table=blocks_t.view(b, nblk) if b else None,
            decode_lens=ctx_t if b else None,
            prefills=spans,
            paged=self.paged_decode,
        )
        return ids_t, pos_t, meta, rows_t


VERIFY_AS_DECODE_ROWS = 16  # verification items up to this many tokens run as decode rows
# A prompt chunk beside decodes runs as decode rows while its rows x its context stay within
# this many token reads a layer (_prompts_as_decodes). Measured on the 1.5B Qwen beside one
# decoder (benchmarks/bench_mixed_step.py --both-ways, Ice Lake 2 vCPU): from position 0, 4 /
# 16 / 64 rows took 71 / 177 / 644 ms as decode rows against 91 / 204 / 682 through the
# Python layers; from position 2,000, 4 rows (8 K reads) 122 against 143 ms, but 16 rows
# (32 K) 346 against 299 and 64 rows 1,207 against 837.
PROMPT_AS_DECODES_READS = 16 * 1024


def _verify_as_decodes(it: StepItem) -> bool:
    return it.all_logits and it.start_pos > 0 and len(it.token_ids) <= VERIFY_AS_DECODE_ROWS


def _run_start(blocks: list[int]) -> int | None:
    """The first of `blocks` if they are consecutive ids (sliced as one view), else None."""
    first = blocks[0]
    if blocks[-1] - first == len(blocks) - 1 and blocks == list(range(first, first + len(blocks))):
        return first
    return None
