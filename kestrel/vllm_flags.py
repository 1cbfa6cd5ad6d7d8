"""vLLM `serve` flags that kestrel does not take, and why: `kestrel serve` names them in its error.

Flags with the same name and meaning in both (--host, --port, --api-key, --served-model-name,
--max-num-seqs, --max-model-len, --max-num-batched-tokens, --block-size, --dtype, --device,
--enable-prefix-caching, --quantization) are ordinary settings fields, not listed here.
"""

from __future__ import annotations

_PARALLEL = ("one worker runs one device; for more devices start more workers "
             "(kestrel-worker --gateway-address ...) and the gateway balances them")
_HUB = "nothing is fetched from a model hub: pass a local folder or a .gguf file as MODEL"
_CHECKPOINT = "the tokenizer and chat template come from the checkpoint (or the GGUF file)"
_LOG = "use --log-level (both processes log one JSON object a line)"

UNSUPPORTED: dict[str, str] = {
    "--tensor-parallel-size": _PARALLEL, "-tp": _PARALLEL,
    "--pipeline-parallel-size": _PARALLEL, "-pp": _PARALLEL,
    "--data-parallel-size": _PARALLEL, "-dp": _PARALLEL,
    "--distributed-executor-backend": _PARALLEL,
    "--gpu-memory-utilization": "use --kv-cache-memory FRACTION: the KV cache's share of the "
                                "memory free at start (weights not included), or BYTES",
    "--kv-cache-memory-bytes": "use --kv-cache-memory BYTES (or a fraction)",
    "--swap-space": "there is no CPU swap space: a preempted sequence is recomputed",
    "--cpu-offload-gb": "weights are not offloaded",
    "--enforce-eager": "eager is the default; --compile decode compiles one-token decode steps "
                       "(torch.compile), --compile off is this flag",
    "--compilation-config": "the only compile setting is --compile off|decode",
    "-O": "no compilation levels; see --compile",
    "--trust-remote-code": "kestrel runs its own Llama-family code, never a checkpoint's code",
    "--tokenizer": _CHECKPOINT, "--tokenizer-mode": _CHECKPOINT, "--chat-template": _CHECKPOINT,
    "--load-format": _HUB, "--download-dir": _HUB, "--revision": _HUB, "--hf-token": _HUB,
    "--tokenizer-revision": _HUB, "--code-revision": _HUB, "--hf-overrides": _HUB,
    "--enable-chunked-prefill": "chunked prefill is always on, its chunks sized by measured "
                                "step time (--step-prefill-share); --max-num-batched-tokens "
                                "caps a step's rows",
    "--no-enable-chunked-prefill": "chunked prefill is always on",
    "--seed": "seeds are per request (the `seed` field)",
    "--max-logprobs": "a request may ask for up to 5 logprobs",
    "--enable-lora": "no LoRA adapters", "--lora-modules": "no LoRA adapters",
    "--max-loras": "no LoRA adapters", "--max-lora-rank": "no LoRA adapters",
    "--speculative-config": "speculative decoding has its own flags (see --help)",
    "--guided-decoding-backend": "structured output always uses llguidance",
    "--structured-outputs-config": "structured output always uses llguidance",
    "--enable-auto-tool-choice": "tool calling is always on (tool_choice auto included)",
    "--tool-call-parser": "tool calls use kestrel's own <tool_call> format (see the README)",
    "--reasoning-parser": "no reasoning parser",
    "--disable-log-requests": _LOG, "--disable-log-stats": _LOG, "--uvicorn-log-level": _LOG,
    "--ssl-keyfile": "serve TLS from a reverse proxy", "--ssl-certfile": "serve TLS from a "
                                                                         "reverse proxy",
    "--root-path": "serve under a path prefix from a reverse proxy",
    "--allowed-origins": "no CORS handling", "--config": "settings are flags and KESTREL_* "
                                                         "variables",
    "--generation-config": "sampling defaults are OpenAI's", "--task": "text generation only",
    "--runner": "text generation only", "--scheduling-policy": "scheduling is first come, "
                                                               "first served",
    "--num-scheduler-steps": "one step per scheduling round",
    "--enable-sleep-mode": "no sleep mode", "--limit-mm-per-prompt": "text only",
    "--otlp-traces-endpoint": "no tracing export yet",
    "--disable-frontend-multiprocessing": "the gateway is always its own process",
}


def unsupported_reason(flag: str) -> str | None:
    """Why kestrel does not take this vLLM flag (`--flag` or `--flag=value`); None if not one."""
    return UNSUPPORTED.get(flag.split("=", 1)[0])
