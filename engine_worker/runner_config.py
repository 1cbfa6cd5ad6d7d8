"""The model runner's config: one frozen object, built once and never changed after.

    WorkerConfig (flags, KESTREL_*) --RunnerConfig.from_worker--> RunnerConfig --> ModelRunner
                                                                       |
                                           .for_draft(checkpoint) ----+--> the draft's runner

`from_worker` resolves everything that needs a look at the host or the checkpoint (the model
folder, a GGUF file served natively, the dtype, the KV budget in bytes) so that the worker, the
draft runner and every benchmark build their runner the same way; a benchmark's own flags override
fields with `dataclasses.replace`. No torch here: dtypes are named as torch attributes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from engine_worker.config import (
    COMPILE_MODES,
    DECODE_STACK_MODES,
    HUGE_PAGES_MODES,
    KV_CACHE_DTYPES,
    PAGED_ATTENTION_MODES,
    QUANT_GROUP_SIZES,
    QUANTIZATIONS,
    WorkerConfig,
    cache_dir_from_env,
    check_choices,
)
from engine_worker.memory_budget import kv_budget

AUTO = -1  # dense_min_rows: measured on this host (engine_worker/path_choice.py)
RUN_DTYPES = ("float32", "bfloat16", "float16")


def resolve_kv_dtype(name: str, dtype: str, device: str) -> str:
    """The KV cache's dtype for --kv-cache-dtype `name`: as named, or for auto bfloat16 on a
    CPU (half the bytes a decode step reads of float32's, whatever the activations; the C++
    kernels read it in place, and its float32 exponent range cannot overflow where float16's
    could), the activations' own 16-bit dtype elsewhere."""
    if name != "auto":
        return name
    if device == "cpu" or dtype not in ("bfloat16", "float16"):
        return "bfloat16"
    return dtype


@dataclass(frozen=True)
class RunnerConfig:
    model_path: Path  # a checkpoint folder: config.json, and the weights unless gguf_path is set
    kv_budget_bytes: int  # the KV cache's memory; its block count follows from the model
    dtype: str = "float32"  # activations (torch attribute name)
    # the KV cache's (KV_CACHE_DTYPES; auto: resolve_kv_dtype)
    kv_cache_dtype: str = "auto"
    kv_budget_why: str = ""  # where kv_budget_bytes came from, for the start log
    device: str = "cpu"
    # Serve this GGUF file's own quantized blocks (model_path then only supplies config.json);
    # activations are float32 and `quantization` must be none.
    gguf_path: Path | None = None
    quantization: str = "none"  # weight-only: none | int8 | int4 (engine_worker/model/quant.py)
    # a GGUF's wider blocks re-quantized at load (a draft model's; model/requantize.py)
    requantize: str = "none"
    group_size: int = 32  # INT4 group size
    # From this many rows GGUF-native layers (and INT4's head) compute with a bfloat16 copy;
    # 0: none; AUTO: measured on this host for GGUF, native bfloat16 decides otherwise.
    dense_min_rows: int = AUTO
    # "auto" reads decode contexts in place with the C++ kernel where it builds; "gather"
    # copies them.
    paged_attention: str = "auto"
    # "auto": decode rows through the C++ decode stack where it serves (model/decode_stack.py)
    decode_stack: str = "auto"
    # "auto": the integer-dot layers' packed weights copied into 2 MiB pages on a CPU host with
    # transparent huge pages (model/huge_pages.py); "off": the block cache's file maps serve
    huge_pages: str = "auto"
    compile_mode: str = "off"  # "decode": torch.compile one-token decode steps
    block_size: int = 16
    max_model_len: int | None = None  # None: the checkpoint's context clamped to the KV capacity
    max_num_seqs: int = 32  # the compiled graphs' largest batch
    num_threads: int | None = None  # torch CPU threads (process-wide; None: torch's default)
    # With num_threads None: the count measured while serving where the decode stack serves
    # (engine_worker/thread_choice.py); the worker's --threads 0
    adapt_threads: bool = False
    # Where our C++ kernels are built once per host and Inductor keeps its graphs; without a
    # compiler the kernels are not used and torch's kernels (and the gather) serve instead.
    cache_dir: Path = field(default_factory=cache_dir_from_env)
    # With a draft model: the draft's share of --kv-cache-memory (None: the same budget again).
    draft_kv_budget_bytes: int | None = None

    def __post_init__(self) -> None:
        check_choices(self, {"dtype": RUN_DTYPES, "quantization": QUANTIZATIONS,
                             "group_size": QUANT_GROUP_SIZES, "compile_mode": COMPILE_MODES,
                             "paged_attention": PAGED_ATTENTION_MODES,
                             "decode_stack": DECODE_STACK_MODES,
                             "huge_pages": HUGE_PAGES_MODES,
                             "kv_cache_dtype": KV_CACHE_DTYPES})
        if self.gguf_path is not None and (self.quantization != "none"
                                           or self.dtype != "float32"):
            raise ValueError("GGUF-native weights run float32 activations, no re-quantization")
        if self.block_size <= 0 or self.max_num_seqs <= 0 or self.dense_min_rows < AUTO:
            raise ValueError("block_size and max_num_seqs must be positive, "
                             "dense_min_rows >= -1")

    @classmethod
    def from_worker(cls, cfg: WorkerConfig) -> RunnerConfig:
        """The runner the worker's settings name: the checkpoint found (a GGUF file converted
        into the cache dir once), the dtype resolved, the KV budget measured now."""
        from engine_worker.model.loader import gguf_source, resolve_checkpoint, resolve_dtype

        cache = Path(cfg.cache_dir)
        checkpoint = resolve_checkpoint(cfg.model, cache, weights=False)
        dtype, gguf = resolve_dtype(cfg.dtype, cfg.model, cfg.quantization, checkpoint)
        if gguf is None and gguf_source(cfg.model) is not None:  # a float path asked of a GGUF
            checkpoint = resolve_checkpoint(cfg.model, cache)
        kv_dtype = resolve_kv_dtype(cfg.kv_cache_dtype, dtype, cfg.device)
        draft = cfg.draft_model if cfg.speculative_method == "draft" else ""
        most = _whole_contexts(checkpoint, kv_dtype, cfg.max_num_seqs, cfg.max_model_len,
                               draft, cache)
        budget = kv_budget(cfg.kv_cache_memory, cfg.kv_cache_mb, cfg.device, most)
        total, draft_budget = budget.bytes, None
        if draft:
            total, draft_budget = _split_kv(total, checkpoint, kv_dtype, draft, cache)
        return cls(
            model_path=checkpoint,
            kv_budget_bytes=total,
            kv_budget_why=budget.why,
            draft_kv_budget_bytes=draft_budget,
            dtype=dtype,
            kv_cache_dtype=kv_dtype,
            device=cfg.device,
            gguf_path=gguf,
            quantization=cfg.quantization,
            group_size=cfg.quant_group_size,
            dense_min_rows=cfg.dense_min_rows,
            paged_attention=cfg.paged_attention,
            decode_stack=cfg.decode_stack,
            huge_pages=cfg.huge_pages,
            compile_mode=cfg.compile,
            block_size=cfg.block_size,
            max_model_len=cfg.max_model_len or None,
            max_num_seqs=cfg.max_num_seqs,
            num_threads=cfg.threads or None,
            adapt_threads=not cfg.threads,
            cache_dir=cache,
        )

    @classmethod
    def from_settings(cls, model: str | Path, **settings: object) -> RunnerConfig:
        """What a worker started with these settings (WorkerConfig fields, e.g. dtype="auto",
        kv_cache_mb=256) would build, with KESTREL_CACHE_DIR as its cache dir unless given:
        how benchmarks and tools get their runner."""
        settings.setdefault("cache_dir", str(cache_dir_from_env()))
        return cls.from_worker(WorkerConfig(model=str(model), **settings))  # type: ignore[arg-type]

    def for_draft(self, checkpoint: Path, gguf_path: Path | None = None,
                  requantize: str = "none") -> RunnerConfig:
        """A speculative draft model's runner beside this one: the same device, its share of
        the KV budget (from_worker splits --kv-cache-memory between the two), block size,
        attention path and cache dir; its own checkpoint (a GGUF served from its own blocks,
        `requantize`d where wider, float32 activations), eager, at its own context."""
        return replace(self, model_path=Path(checkpoint), gguf_path=gguf_path,
                       requantize=requantize if gguf_path is not None else "none",
                       kv_budget_bytes=self.draft_kv_budget_bytes or self.kv_budget_bytes,
                       draft_kv_budget_bytes=None,
                       dtype="float32" if gguf_path is not None else self.dtype,
                       quantization="none", dense_min_rows=AUTO, compile_mode="off",
                       max_model_len=None, num_threads=None, adapt_threads=False)



def _kv_per_token(folder: Path, kv_dtype: str) -> int:
    """K and V bytes of one token over all layers of the checkpoint in `folder`."""
    # only here, in the worker's process: this module stays torch-free to import
    from engine_worker.kv_cache import kv_cache_bytes, kv_torch_dtype
    from engine_worker.model.loader import load_config

    return kv_cache_bytes(load_config(folder), 1, kv_torch_dtype(kv_dtype))


def _whole_contexts(target: Path, kv_dtype: str, seqs: int, max_model_len: int,
                    draft_model: str, cache: Path) -> int:
    """The bytes of `seqs` whole contexts (the checkpoint's, or max_model_len when set) of the
    target, and of its draft when one is named: no default budget need be larger."""
    from engine_worker.model.loader import gguf_source, load_config, resolve_checkpoint

    context = max_model_len or load_config(target).max_position_embeddings
    per_token = _kv_per_token(target, kv_dtype)
    if draft_model:
        draft = resolve_checkpoint(draft_model, cache, weights=gguf_source(draft_model) is None)
        per_token += _kv_per_token(draft, kv_dtype)
    return per_token * context * seqs


def _split_kv(total: int, target: Path, kv_dtype: str, draft_model: str,
              cache: Path) -> tuple[int, int]:
    """--kv-cache-memory shared by the target and its draft model in proportion to their K/V
    bytes per token, so both caches hold the same number of tokens and together stay within it
    (both in the target's KV dtype)."""
    from engine_worker.model.loader import gguf_source, resolve_checkpoint

    draft = resolve_checkpoint(draft_model, cache, weights=gguf_source(draft_model) is None)
    t, d = _kv_per_token(target, kv_dtype), _kv_per_token(draft, kv_dtype)
    target_share = total * t // (t + d)
    return target_share, total - target_share
