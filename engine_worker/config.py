"""The worker's settings: flags and KESTREL_* variables, validated once at start."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from protocol.settings import setting
from protocol.transport import DEFAULT_ENGINE_ADDRESS

DTYPES = ("auto", "float32", "bfloat16", "float16", "half")
QUANTIZATIONS = ("none", "int8", "int4")
QUANT_GROUP_SIZES = (32, 64, 128)


def default_cache_dir() -> str:
    return str(Path.home() / ".cache" / "kestrel")


@dataclass(frozen=True)
class WorkerConfig:
    gateway_address: str = setting(DEFAULT_ENGINE_ADDRESS, "ZeroMQ address of the gateway")
    model: str = setting(
        "default",
        "'default' (the embedded SmolLM2-135M-Instruct), a local Hugging Face checkpoint "
        "folder, or a .gguf file",
    )
    model_id: str = setting("", "name the model is served as (default: from the checkpoint)")
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
    dense_min_rows: int = setting(4, "GGUF-native weights: from this many rows a step computes "
                                  "with a bfloat16 copy of each layer (~230 MiB more for "
                                  "SmolLM2, faster batches); 0 keeps only the packed blocks")
    kv_cache_mb: int = setting(512, "memory budget of the KV cache, in MiB")
    block_size: int = setting(16, "tokens per KV cache block")
    max_model_len: int = setting(0, "longest prompt + output in tokens (0: checkpoint's "
                                 "context clamped to the KV capacity)")
    max_num_seqs: int = setting(32, "most sequences in the running batch")
    max_num_batched_tokens: int = setting(512, "token budget of one engine step (chunked prefill)")
    prefix_caching: bool = setting(True, "reuse KV blocks of shared prompt prefixes")
    heartbeat_s: float = setting(0.25, "seconds between heartbeats to the gateway")
    drain_timeout_s: float = setting(30.0, "on SIGTERM, how long in-flight requests may finish")
    threads: int = setting(0, "torch CPU threads (0: torch's default)")
    log_level: str = setting("INFO", "DEBUG, INFO, WARNING or ERROR")

    def __post_init__(self) -> None:
        if not self.gateway_address.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"gateway_address must be a ZeroMQ address: {self.gateway_address!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, not {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, "
                             f"not {self.quantization!r}")
        if self.quant_group_size not in QUANT_GROUP_SIZES:
            raise ValueError(f"quant_group_size must be one of {QUANT_GROUP_SIZES}")
        positive = ("kv_cache_mb", "block_size", "max_num_seqs", "max_num_batched_tokens")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs, or some decoding "
                             "sequences would never get a token")
        if self.max_model_len < 0 or self.threads < 0 or self.dense_min_rows < 0:
            raise ValueError("max_model_len, threads and dense_min_rows must be >= 0")
        if self.heartbeat_s <= 0 or self.drain_timeout_s < 0:
            raise ValueError("heartbeat_s must be > 0 and drain_timeout_s >= 0")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ValueError(f"unknown log_level {self.log_level!r}")
