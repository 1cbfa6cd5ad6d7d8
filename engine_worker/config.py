"""The worker's settings: flags and KESTREL_* variables, validated once at start."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from common.settings import setting
from engine_worker.memory_budget import parse_kv_memory
from engine_worker.step_costs import DEFAULT_PREFILL_SHARE, DEFAULT_STEP_FLOOR_S
from protocol.transport import DEFAULT_ENGINE_ADDRESS

DTYPES = ("auto", "float32", "bfloat16", "float16", "half")
QUANTIZATIONS = ("none", "int8", "int4")
QUANT_GROUP_SIZES = (32, 64, 128)
SPECULATIVE_METHODS = ("off", "ngram", "draft")
# The formats model/requantize.py re-quantizes a draft to (listed here, where torch is not
# imported, for --speculative-draft-quantization's choices)
REQUANTIZE_FORMATS = ("q4_0",)
DRAFT_QUANTIZATIONS = ("auto", "none", *REQUANTIZE_FORMATS)
PAGED_ATTENTION_MODES = ("auto", "gather")
# The KV cache's element type (vLLM's --kv-cache-dtype names); auto: bfloat16 on a CPU, the
# activations' 16-bit dtype on a GPU (engine_worker/runner_config.py resolve_kv_dtype).
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8")
DECODE_STACK_MODES = ("auto", "off")
HUGE_PAGES_MODES = ("auto", "off")  # the packed weights: 2 MiB pages, or the file maps
POOLINGS = ("mean", "last")  # embeddings (engine_worker/embedding.py)
COMPILE_MODES = ("off", "decode")  # the runner's decode paths: eager, or compiled one-token steps


def check_choice(name: str, value: object, choices: tuple[object, ...]) -> None:
    """Raise ValueError unless `value` is one of `choices`: a setting checked once, at start."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, not {value!r}")


def check_choices(settings: object, choices: dict[str, tuple[object, ...]]) -> None:
    """check_choice for each field named in `choices`."""
    for name, allowed in choices.items():
        check_choice(name, getattr(settings, name), allowed)


def default_cache_dir() -> str:
    return str(Path.home() / ".cache" / "kestrel")


def cache_dir_from_env() -> Path:
    """KESTREL_CACHE_DIR, else the default: where a process with no WorkerConfig (the runner
    used directly, benchmarks, tests) finds converted checkpoints and built kernels."""
    return Path(os.environ.get("KESTREL_CACHE_DIR", default_cache_dir()))


@dataclass(frozen=True)
class WorkerConfig:
    gateway_address: str = setting(DEFAULT_ENGINE_ADDRESS, "ZeroMQ address of the gateway (one "
                                   "per API server process, comma-separated)")
    model: str = setting(
        "default",
        "'default' (the embedded SmolLM2-135M-Instruct), a local Hugging Face checkpoint "
        "folder, or a .gguf file",
    )
    model_id: str = setting("", "names the model is served as: the first is its id, the others "
                            "aliases requests may use (default: from the checkpoint or the "
                            "GGUF file's name)", flags=("--served-model-name",), repeat="extend")
    chat_template: str = setting("", "a Jinja chat template file that replaces the model's "
                                 "(sent to the gateway in the Hello; vLLM's --chat-template)")
    cache_dir: str = setting(default_cache_dir(), "where converted checkpoints are kept")
    device: str = setting("cpu", "torch device: cpu, cuda, cuda:1 ...")
    dtype: str = setting("auto", "weights and activations dtype: " + ", ".join(DTYPES) +
                         "; auto = a GGUF model's own quantized blocks (Q4_0/Q4_1/Q8_0 served "
                         "packed; float32 when --quantization re-quantizes), the checkpoint's "
                         "dtype otherwise")
    quantization: str = setting("none", "weight-only quantization: none, int8 (per output "
                                "channel) or int4 (group-wise, packed)")
    quant_group_size: int = setting(32, "INT4 group size: 32, 64 or 128; a layer whose input "
                                    "width it does not divide uses the largest that does")
    dense_min_rows: int = setting(-1, "GGUF-native weights: from this many rows a step computes "
                                  "with a bfloat16 copy of each layer (~230 MiB more for "
                                  "SmolLM2); 0 keeps only the packed blocks; -1 (default) "
                                  "measures the paths on this host at the first start and "
                                  "keeps the choice in the cache dir (no copy without native "
                                  "bfloat16)")
    paged_attention: str = setting("auto", "CPU decode attention: auto (a C++ kernel reads the "
                                   "paged KV cache in place; built for this host on the first "
                                   "start, ~10 s, kept in the cache dir; gather where it cannot "
                                   "build) or gather (copy each context, then SDPA)")
    decode_stack: str = setting("auto", "GGUF layers on the integer-dot kernel (CPU): auto runs "
                                "a step's decode rows through every layer in one C++ call "
                                "(built on the first start, kept in the cache dir); off: layer "
                                "by layer in Python, the reference")
    huge_pages: str = setting("auto", "GGUF layers on the integer-dot kernel (CPU): auto copies "
                              "their packed weights into 2 MiB pages where the host has "
                              "transparent huge pages (a decode step streams them: a tenth "
                              "faster on a Zen 4); off serves them from the block cache's "
                              "file maps, which two workers of one file share")
    compile: str = setting("off", "decode: run one-token decode steps through torch.compile "
                           "graphs (batch and context padded to power-of-two buckets, each "
                           "compiled on first use: 40-100 s a bucket on 2 cores, ~5-10 s from "
                           "the on-disk cache under --cache-dir; then 7-33%% faster a step, "
                           "measured); off: eager (vLLM's --enforce-eager)")
    kv_cache_mb: int = setting(0, "memory budget of the KV cache, in MiB; 0 (default): a "
                               "quarter of the memory available when the worker starts, at "
                               "most what --max-num-seqs sequences of the model's whole "
                               "context hold (the pages are the host's only once written)")
    kv_cache_memory: str = setting("", "KV cache budget, overriding kv_cache_mb: bytes "
                                   "(2147483648, 2GiB, 512MB) or a fraction in (0, 1) of the "
                                   "memory available when the worker starts (CPU: the host's "
                                   "MemAvailable; CUDA: the device's free memory), weights not "
                                   "subtracted")
    kv_cache_dtype: str = setting("auto", "the KV cache's dtype: auto (bfloat16 on a CPU: half "
                                  "the bytes of float32 read at every step and twice the "
                                  "context in the same memory; the activations' 16-bit dtype "
                                  "on a GPU), float32, bfloat16, float16, or int8 / fp8 (one "
                                  "byte a value and a float16 scale per 32: about half a "
                                  "16-bit cache; engine_worker/kv_cache.py). int8 kept the "
                                  "1.5B Qwen's perplexity within 0.2 %%; fp8's 3 mantissa bits "
                                  "cost it 56 %% (SmolLM2 0.3 %%)")
    block_size: int = setting(16, "tokens per KV cache block")
    max_model_len: int = setting(0, "longest prompt + output in tokens (0: checkpoint's "
                                 "context clamped to the KV capacity)")
    max_num_seqs: int = setting(32, "most sequences in the running batch")
    max_num_batched_tokens: int = setting(512, "most token rows one engine step computes (a cap: "
                                          "a step's prompt rows are sized by its measured time, "
                                          "see --step-prefill-share)")
    step_prefill_share: float = setting(DEFAULT_PREFILL_SHARE, "while sequences decode, the "
                                        "share of a step carrying prompt rows that they may "
                                        "take, measured against a lone decoder's step on this "
                                        "host (2/3: such a step lasts at most 3x a one-stream "
                                        "decode step); 0: off, --max-num-batched-tokens alone "
                                        "sizes steps")
    step_floor_ms: float = setting(DEFAULT_STEP_FLOOR_S * 1e3, "a step carrying prompt rows "
                                   "may last this long whatever --step-prefill-share says (50: "
                                   "20 tokens a second to each stream, where a lone decoder's "
                                   "step is a few ms); larger: fewer, larger prompt chunks for "
                                   "longer gaps between a decoder's tokens; 0: off")
    pooling: str = setting("mean", "how /v1/embeddings pools an input's last hidden states "
                           "into its vector: mean (over its tokens) or last (its last token's)")
    prefix_caching: bool = setting(True, "reuse KV blocks of shared prompt prefixes",
                                   flags=("--enable-prefix-caching",))
    link_secret_key: str = setting("", "this worker's CURVE secret certificate (NAME.key_secret "
                                   "from kestrel-keygen); with --link-gateway-key turns on "
                                   "authentication and encryption of the engine link")
    link_gateway_key: str = setting("", "the gateway's public certificate (its .key file)")
    speculative_method: str = setting("off", "speculative decoding: off, ngram (prompt lookup) "
                                      "or draft (a small model sharing the tokenizer)")
    num_speculative_tokens: int = setting(4, "draft tokens proposed per sequence and step")
    draft_model: str = setting("", "draft model for --speculative-method draft: a checkpoint "
                               "folder or .gguf sharing the served model's tokenizer")
    speculative_max_batch: int = setting(4, "speculate only in steps with at most this many "
                                         "running sequences (a busy batch gains nothing)")
    speculative_min_acceptance: float = setting(0.3, "a sequence whose drafts are accepted less "
                                                "often than this pauses speculation a while")
    speculative_draft_confidence: str = setting(
        "auto", "a draft model stops a round's drafts where the odds it gives the next one fall "
        "below this (0..1; 0: always --num-speculative-tokens); auto: the measured price of a "
        "draft, its pass and one more verified row, in target steps")
    speculative_draft_quantization: str = setting(
        "auto", "a GGUF draft model's wider blocks re-quantized at load, so each draft reads "
        "fewer bytes (the output is the served model's either way): q4_0, none (its own "
        "blocks); auto: q4_0")
    heartbeat_s: float = setting(0.25, "seconds between heartbeats to the gateway")
    drain_timeout_s: float = setting(30.0, "on SIGTERM, how long in-flight requests may finish")
    threads: int = setting(0, "torch CPU threads (0: torch's default, and where the decode "
                           "stack serves, fewer while decode steps are measured faster with "
                           "fewer: a host whose cores are shared)")
    log_level: str = setting("INFO", "DEBUG, INFO, WARNING or ERROR")
    otlp_endpoint: str = setting("", "OpenTelemetry OTLP/HTTP endpoint for traces, e.g. "
                                 "http://127.0.0.1:4318 (empty: tracing off; needs the otel extra)")

    def served_names(self) -> tuple[str, ...]:
        """The names given for the model (empty: derive one from the checkpoint)."""
        return tuple(n.strip() for n in self.model_id.split(",") if n.strip())

    def __post_init__(self) -> None:
        addresses = [a.strip() for a in self.gateway_address.split(",") if a.strip()]
        if not addresses or not all(a.startswith(("tcp://", "ipc://", "inproc://"))
                                    for a in addresses):
            raise ValueError("gateway_address must be ZeroMQ addresses (comma-separated for a "
                             f"gateway's several API servers): {self.gateway_address!r}")
        check_choices(self, {"dtype": DTYPES, "quantization": QUANTIZATIONS,
                             "paged_attention": PAGED_ATTENTION_MODES,
                             "decode_stack": DECODE_STACK_MODES, "compile": COMPILE_MODES,
                             "huge_pages": HUGE_PAGES_MODES,
                             "quant_group_size": QUANT_GROUP_SIZES,
                             "speculative_method": SPECULATIVE_METHODS, "pooling": POOLINGS,
                             "speculative_draft_quantization": DRAFT_QUANTIZATIONS,
                             "kv_cache_dtype": KV_CACHE_DTYPES})
        if self.kv_cache_mb < 0:
            raise ValueError("kv_cache_mb must be >= 0 (0: sized from the memory available)")
        positive = ("block_size", "max_num_seqs", "max_num_batched_tokens")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs, or some decoding "
                             "sequences would never get a token")
        parse_kv_memory(self.kv_cache_memory)  # raises ValueError on a bad spelling
        if self.max_model_len < 0 or self.threads < 0 or self.dense_min_rows < -1:
            raise ValueError("max_model_len and threads must be >= 0, dense_min_rows >= -1")
        if self.heartbeat_s <= 0 or self.drain_timeout_s < 0:
            raise ValueError("heartbeat_s must be > 0 and drain_timeout_s >= 0")
        if not 0 <= self.step_prefill_share < 1 or self.step_floor_ms < 0:
            raise ValueError("step_prefill_share must be in [0, 1), step_floor_ms >= 0")
        if bool(self.link_secret_key) != bool(self.link_gateway_key):
            raise ValueError("link_secret_key and link_gateway_key go together")
        if self.chat_template and not Path(self.chat_template).is_file():
            raise ValueError(f"chat_template: no file {self.chat_template!r}")
        for name in ("link_secret_key", "link_gateway_key"):
            if getattr(self, name) and not Path(getattr(self, name)).is_file():
                raise ValueError(f"{name} {getattr(self, name)!r} is not a file")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("num_speculative_tokens must be in 1..16")
        if (self.speculative_method == "draft") != bool(self.draft_model):
            raise ValueError("--draft-model is required with, and only with, "
                             "--speculative-method draft")
        if self.speculative_max_batch < 1 or not 0 <= self.speculative_min_acceptance < 1:
            raise ValueError("speculative_max_batch must be >= 1 and speculative_min_acceptance "
                             "in [0, 1)")
        if self.speculative_draft_confidence != "auto":
            try:
                ok = 0 <= float(self.speculative_draft_confidence) < 1
            except ValueError:
                ok = False
            if not ok:
                raise ValueError("speculative_draft_confidence must be auto or a number in [0, 1)")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ValueError(f"unknown log_level {self.log_level!r}")
