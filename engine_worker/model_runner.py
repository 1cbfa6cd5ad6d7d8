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

from dataclasses import dataclass
from pathlib import Path

import torch

from engine_worker.compiled_step import COMPILE_MODES, CompiledDecode
from engine_worker.config import cache_dir_from_env
from engine_worker.kv_cache import KVCache, num_blocks_for_budget
from engine_worker.model.gguf_native import load_gguf_model
from engine_worker.model.llama import Attention, AttnMeta, PrefillSpan
from engine_worker.model.loader import load_config, load_model
from engine_worker.paged_attention import load_paged_attention
from engine_worker.path_choice import AUTO, PathChoice, choose_paths, native_bf16
from engine_worker.quant import QuantReport, quantize_model, weight_bytes
from engine_worker.quant_group import load_group_gemv

# With dense_min_rows given (not AUTO, which measures: engine_worker/path_choice.py): from this
# many rows GGUF-native layers run a bfloat16 copy through oneDNN. On a CPU with native bfloat16
# the packed INT4 kernel is 2-3x slower at 16 rows, the group-wise INT8 head ~4x; without it the
# copy is 3x slower than the packed path. Costs 2 bytes a weight: ~230 MiB for SmolLM2.
DENSE_ROWS = 4


@dataclass
class StepItem:
    """Tokens at absolute positions start_pos..start_pos+len-1 of one sequence. Their K/V go to
    the slots their block table gives; attention sees positions 0..start_pos+len-1."""

    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    # Logits for every token of the item, not only the last (speculative verification).
    all_logits: bool = False


class ModelRunner:
    def __init__(
        self,
        model_path: Path,
        *,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        kv_budget_bytes: int,
        block_size: int = 16,
        max_model_len: int | None = None,
        num_threads: int | None = None,
        quantization: str = "none",
        group_size: int = 32,
        gguf_path: Path | None = None,
        dense_min_rows: int = AUTO,
        paged_attention: str = "auto",
        compile_mode: str = "off",
        max_num_seqs: int = 32,
        cache_dir: Path | None = None,
    ) -> None:
        """gguf_path: serve that file's own quantized blocks (model_path then only supplies
        config.json); `dtype` is the activations' and KV cache's, `quantization` must be none.
        paged_attention: "auto" reads decode contexts in place with the C++ kernel where it
        builds, "gather" copies them. cache_dir: where our C++ kernels are built once per host and
        Inductor keeps its graphs (default: KESTREL_CACHE_DIR or ~/.cache/kestrel); without a
        compiler the kernels are not used and torch's kernels (and the gather) serve instead."""
        if num_threads is not None:
            # Process-wide by nature; torch's default (one per physical core) is usually right.
            torch.set_num_threads(num_threads)
        self.device = torch.device(device)
        self.dtype = dtype
        self.dtype_name = str(dtype).removeprefix("torch.")
        cfg = load_config(Path(model_path))
        if compile_mode not in COMPILE_MODES:
            raise ValueError(f"compile_mode must be one of {COMPILE_MODES}, not {compile_mode!r}")
        cache_blocks = num_blocks_for_budget(cfg, kv_budget_bytes, block_size, dtype)
        # Compiled decodes pad their batch with rows that write K/V somewhere: the cache's last
        # block, kept out of the ids the block manager hands out (0..num_blocks-1).
        num_blocks = cache_blocks - (compile_mode == "decode")
        if num_blocks <= 0:
            need = "one block" if compile_mode == "off" else "two blocks (one for padding)"
            raise ValueError(f"KV budget of {kv_budget_bytes} bytes is less than {need}")
        limit = min(cfg.max_position_embeddings, num_blocks * block_size)
        if cfg.sliding_window is not None:
            limit = min(limit, cfg.sliding_window)  # full attention is exact only within it
        if max_model_len is None:
            max_model_len = limit
        elif not 0 < max_model_len <= limit:
            raise ValueError(
                f"max_model_len {max_model_len} must be in 1..{limit} (checkpoint context "
                f"{cfg.max_position_embeddings}, KV capacity {num_blocks * block_size} tokens)"
            )
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_blocks = num_blocks
        cache_dir = cache_dir or cache_dir_from_env()
        # Q8_0 (group-wise INT8) layers at few rows: our C++ kernel where it builds (CPU)
        native_q8 = self.device.type == "cpu" and load_group_gemv(cache_dir) is None
        self.paths: PathChoice | None = None  # what was measured for GGUF-native layers
        if gguf_path is not None:
            if quantization != "none" or dtype != torch.float32:
                raise ValueError("GGUF-native weights run float32 activations, no re-quantization")
            compute = dense_dtype = torch.bfloat16
            if dense_min_rows == AUTO and self.device.type == "cpu":  # measured on this host
                self.paths = choose_paths(gguf_path, cache_dir, num_layers=cfg.num_layers,
                                          native_q8=native_q8)
                compute = getattr(torch, self.paths.compute_dtype)
                dense_min_rows = self.paths.dense_min_rows
                dense_dtype = getattr(torch, self.paths.dense_dtype or "bfloat16")
            dense_min_rows = DENSE_ROWS if dense_min_rows == AUTO else dense_min_rows
            self.model = load_gguf_model(gguf_path, cfg, self.device, compute_dtype=compute,
                                         max_positions=max_model_len, dense_dtype=dense_dtype,
                                         dense_min_rows=dense_min_rows, native_q8=native_q8)
            self.quant = QuantReport("gguf", weight_bytes(self.model), weight_bytes(self.model))
        else:
            if dense_min_rows == AUTO:  # the INT4 mode's head copy is bfloat16: only if native
                dense_min_rows = DENSE_ROWS if native_bf16() or self.device.type != "cpu" else 0
            self.model = load_model(Path(model_path), dtype, self.device,
                                    max_positions=max_model_len)
            # Weight-only INT8/INT4 module swaps (engine_worker/quant.py). INT4's (tied) LM
            # head is INT8 per group of 32, as the GGUF path's Q8_0 head: an INT4 head and a
            # per-channel INT8 head (tried) turn SmolLM2's "The capital of France is Paris."
            # into "L'Étoile, ..." (tests/e2e); a float32 head cost 4.5 ms a step.
            # From dense_min_rows rows the head reads a bfloat16 copy (54 MiB for SmolLM2, half
            # the float32 head it replaces): per-group INT8 at 16 rows halved 16-stream tok/s.
            self.quant = quantize_model(self.model, quantization, group_size,
                                        native_q8=native_q8, head_dense_rows=dense_min_rows)
        self.config = self.model.config
        self.paged_attention = load_paged_attention(paged_attention, self.device, dtype,
                                                    cache_dir)
        self.set_paged_attention(self.paged_attention.enabled)
        self.scratch_block = num_blocks  # == cache_blocks - 1 when compiled; unused otherwise
        self.kv_cache = KVCache(self.config, cache_blocks, block_size, dtype, self.device)
        self.compiled: CompiledDecode | None = None
        if compile_mode == "decode":
            self.compiled = CompiledDecode(
                self, max_num_seqs, cache_dir,
                kernel_rows=dense_min_rows if gguf_path is not None else 0)
        # parameters and quantized buffers; a tied embedding (shared tensor) counted once
        self.weight_bytes = weight_bytes(self.model)

    def set_paged_attention(self, on: bool) -> None:
        """Decodes read the cache in place (True; needs the kernel loaded) or gather a copy."""
        if on and not self.paged_attention.enabled:
            raise ValueError(f"paged attention kernel unavailable: {self.paged_attention.reason}")
        self.paged_decode = on
        for mod in self.model.modules():
            if isinstance(mod, Attention):
                mod.paged_decode = on

    @torch.inference_mode()
    def execute(self, items: list[StepItem]) -> torch.Tensor:
        """float32 logits (R, V), one forward pass: a row for the last token of each item, or
        rows for all its tokens when `item.all_logits`, in item order."""
        if not items:
            raise ValueError("execute needs at least one item")
        if self.compiled is not None and self.compiled.supports(items):
            return self.compiled.run(items)  # (B, V): same rows as the eager path
        ids, positions, meta, rows = self._prepare(items)
        return self.model(ids, positions, meta, self.kv_cache, rows)

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

    def _check(self, item: StepItem) -> None:
        n, end = len(item.token_ids), item.start_pos + len(item.token_ids)
        if n == 0 or item.start_pos < 0:
            raise ValueError(f"bad step item: {n} tokens at start_pos {item.start_pos}")
        if end > self.max_model_len:
            raise ValueError(f"positions up to {end} exceed max_model_len {self.max_model_len}")
        used = item.block_table[: -(-end // self.block_size)]
        if len(used) * self.block_size < end:
            raise ValueError(f"block table of {len(item.block_table)} blocks too short for {end}")
        if min(used) < 0 or max(used) >= self.num_blocks:
            raise ValueError(f"block id out of range 0..{self.num_blocks - 1}")

    def _prepare(
        self, items: list[StepItem]
    ) -> tuple[torch.Tensor, torch.Tensor, AttnMeta, torch.Tensor]:
        bs = self.block_size
        for it in items:
            self._check(it)
        # Decodes first so that their rows are one contiguous slice [0, B) for one batched SDPA.
        order = sorted(range(len(items)), key=lambda i: len(items[i].token_ids) > 1)
        decodes = [items[i] for i in order if len(items[i].token_ids) == 1]
        prefills = [items[i] for i in order if len(items[i].token_ids) > 1]

        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        scored: list[list[int]] = [[] for _ in items]  # rows to score of each item
        for i in order:
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
            run = _run_start(decodes[0].block_table[:nblk], bs)
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
                run = _run_start(used, bs)
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
        )
        return ids_t, pos_t, meta, rows_t


def _run_start(blocks: list[int], block_size: int) -> int | None:
    """First slot of `blocks` if they are consecutive ids (readable as one view), else None."""
    first = blocks[0]
    if blocks[-1] - first == len(blocks) - 1 and blocks == list(range(first, first + len(blocks))):
        return first * block_size
    return None


def main(argv: list[str] | None = None) -> None:
    """Decode throughput: python -m engine_worker.model_runner [MODEL] [--batch 1,16] ..."""
    import argparse
    import time

    from engine_worker.model.loader import resolve_checkpoint, resolve_dtype

    ap = argparse.ArgumentParser(allow_abbrev=False,
                                 description="Greedy decode throughput through execute().")
    ap.add_argument("model", nargs="?", default="default")
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dense-min-rows", type=int, default=AUTO,
                    help="GGUF-native: a copy from this many rows (0: none; -1: measured)")
    ap.add_argument("--compile", default="off", choices=COMPILE_MODES,
                    help="decode: compiled one-token steps (benchmarks/bench_compiled_decode.py "
                         "compares them with eager side by side)")
    args = ap.parse_args(argv)
    cache = cache_dir_from_env()
    path = resolve_checkpoint(args.model, cache)
    dtype, gguf = resolve_dtype(args.dtype, args.model, args.quantization, path)
    runner = ModelRunner(
        path,
        dtype=getattr(torch, dtype),
        gguf_path=gguf,
        quantization=args.quantization,
        device=args.device,
        kv_budget_bytes=1 << 30,
        num_threads=args.threads,
        dense_min_rows=args.dense_min_rows,
        compile_mode=args.compile,
        max_num_seqs=max(int(x) for x in args.batch.split(",")),
        cache_dir=cache,
    )
    nblk = -(-(args.prompt + args.steps) // runner.block_size)
    for b in (int(x) for x in args.batch.split(",")):
        tables = [list(range(i * nblk, (i + 1) * nblk)) for i in range(b)]
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(100, 40000, (b, args.prompt), generator=g).tolist()
        t0 = time.perf_counter()
        toks = runner.execute([StepItem(prompts[i], 0, tables[i]) for i in range(b)]).argmax(-1)
        prefill = time.perf_counter() - t0
        if runner.compiled is not None:  # compile (or load) this batch's graphs untimed
            ctx = range(args.prompt + 1, args.prompt + args.steps + 1)
            runner.compiled.warm({runner.compiled.bucket(b, -(-n // runner.block_size))
                                  for n in ctx})
        t0 = time.perf_counter()
        for s in range(args.steps):
            items = [StepItem([int(toks[i])], args.prompt + s, tables[i]) for i in range(b)]
            toks = runner.execute(items).argmax(-1)
        dt = time.perf_counter() - t0
        print(
            f"{args.dtype}/{args.quantization}/compile {args.compile} batch {b}: prefill "
            f"{b}x{args.prompt} {prefill * 1e3:.0f} ms, decode "
            f"{dt / args.steps * 1e3:.1f} ms/step, {b * args.steps / dt:.1f} tok/s",
            flush=True,
        )


if __name__ == "__main__":
    main()
