"""Message structs shared by the gateway and the engine workers. Structs only: no I/O, no torch.

Data flow over one ZeroMQ link (gateway ROUTER <-> worker DEALER):

    worker  -> gateway : Hello (first), Heartbeat (periodic, carries Stats), StepOutputs (one
                         per engine step: every sequence's TokenOutput of that step),
                         RequestError, WorkerDying, ProtocolError
    gateway -> worker  : Welcome (answer to Hello), Generate, Cancel, Reset, ProtocolError

Each message is a frozen dataclass whose fields are msgpack-native types (ints, floats, strs,
bytes, lists, dicts, None), fixed-shape tuples (sent as lists), string literals, or other
message dataclasses. The codec (`protocol.codec`) maps each class to one type byte and checks
every field against its annotation on decode.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# 2: Generate carries the remaining time (timeout_s), not a wall-clock deadline; Hello carries
# the KV block size and a tokenizer digest.
# 3: Generate.cache_salt. 4: token frames travel in one StepOutputs per engine step.
# 5: Stats.step_costs and Hello.step_costs (the worker's measured step costs).
# 6: embeddings: Generate.embed and input_lengths, TokenOutput.embedding, Hello.embedding_size.
PROTOCOL_VERSION = 6

# Why a choice ended. stop: an end-of-sequence or stop token; length: max_tokens or the context;
# abort: cancelled (client gone, a stop string met at the gateway, worker shutting down);
# timeout: its deadline passed in the worker.
FinishReason = Literal["stop", "length", "abort", "timeout"]
# One new token's logprobs: (token id, logprob, [(top id, top logprob), ...]); lists on the wire.
TopLogprob = tuple[int, float]
LogprobEntry = tuple[int, float, list[TopLogprob]]


@dataclass(frozen=True)
class SamplingParams:
    """Per-sequence sampling settings. Validated by the gateway before they are sent."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1): no top-k
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's: logits of tokens in the prompt or the output divided by it (multiplied if < 0)
    repetition_penalty: float = 1.0
    min_p: float = 0.0  # tokens less probable than min_p x the top one are never drawn
    min_tokens: int = 0  # no EOS nor stop_token_ids before this many tokens
    logit_bias: list[tuple[int, float]] = field(default_factory=list)  # (token id, bias) pairs
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's logprob and k top ones
    n: int = 1
    speculative: bool = True  # False: this request opts out of the worker's speculative decoding


@dataclass(frozen=True)
class TokenizerInfo:
    """What a gateway needs to tokenize for a model, sent by the worker in its Hello."""

    tokenizer_json: str  # the `tokenizers` library's JSON
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    eos_token_ids: list[int]
    add_bos_token: bool = False


@dataclass(frozen=True)
class StepCosts:
    """What one engine step costs on the worker's host, measured from its steps
    (engine_worker.step_costs): the gateway's admission estimates from it, /metrics shows it."""

    decode_s: list[tuple[float, float]]  # (decode rows, seconds of a step with only those)
    prefill_row_s: list[tuple[int, float]]  # (rows bucket, seconds each prompt row adds)
    prefill_share: float  # most of a step prompts may take while sequences decode
    max_rows: int  # rows one step may carry at most (--max-num-batched-tokens)
    # Cumulative histograms (upper edge, count), every step since the worker started.
    step_seconds: list[tuple[float, int]] = field(default_factory=list)
    step_seconds_sum: float = 0.0
    prefill_rows: list[tuple[float, int]] = field(default_factory=list)
    prefill_rows_sum: float = 0.0


@dataclass(frozen=True)
class Stats:
    """Engine figures, sent with every heartbeat."""

    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_cache_hits: int = 0  # tokens served from cached blocks (cumulative)
    prefix_cache_queries: int = 0  # prompt tokens looked up (cumulative)
    preemptions: int = 0  # cumulative
    generated_tokens: int = 0  # cumulative, aborted requests' included
    prompt_tokens: int = 0  # cumulative
    # Speculative decoding (cumulative draft tokens proposed / accepted; 0 when it is off).
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    # Verify steps (one per sequence per step that carried drafts, cumulative): accepted tokens
    # over these is the mean accepted length per step.
    spec_verify_steps: int = 0
    # Times the worker, going idle, found state that no request held (Engine.check_idle).
    idle_check_failures: int = 0
    step_costs: StepCosts | None = None  # None: nothing measured (or a worker that measures none)


@dataclass(frozen=True)
class Hello:
    protocol_version: int
    worker_id: str  # unique per process life: a restarted worker is a new worker
    model_id: str
    max_model_len: int
    kv_capacity_tokens: int
    max_num_seqs: int
    tokenizer: TokenizerInfo
    device: str = "cpu"
    dtype: str = "float32"
    quantization: str = "none"
    weight_bytes: int = 0
    aliases: list[str] = field(default_factory=list)  # other names requests may use
    block_size: int = 16  # tokens per KV block: the gateway's prefix index hashes blocks this size
    # sha256 of the tokenizer (protocol.tokenizer_digest). The gateway recomputes it from
    # `tokenizer` and refuses a Hello whose digest, or whose tokenizer, differs from the one its
    # model was registered with.
    tokenizer_digest: str = ""
    step_costs: StepCosts | None = None  # measured before the Hello (Engine.probe)
    # Floats in one of this worker's embeddings (its model's hidden size); 0: it serves none.
    embedding_size: int = 0
    # Which kernel every matmul runs, by weight kind and rows: the worker's `matmul plan:` log
    # line (engine_worker/model/matmul_plan.py), shown by the gateway's /health.
    matmul_plan: str = ""
    # What one decode step of one sequence reads (issue 53), shown by /health: the weights'
    # bytes (engine_worker/model/quant.py decode_read_bytes), and the KV cache's bytes per token
    # of its context in the cache's dtype.
    kv_cache_dtype: str = ""
    decode_read_bytes: int = 0
    kv_bytes_per_token: int = 0


@dataclass(frozen=True)
class Welcome:
    """The gateway's answer to a Hello; when not accepted, `reason` says why (version...)."""

    protocol_version: int
    accepted: bool
    reason: str = ""


@dataclass(frozen=True)
class Generate:
    request_id: str  # unique across workers
    prompt_token_ids: list[int]
    params: SamplingParams
    # Seconds left until the request's deadline when the gateway sent it; None: no deadline.
    # Remaining time, not a wall-clock instant: the two hosts' clocks need not agree.
    timeout_s: float | None = None
    # Local to the receiving worker, never meaningful on the wire: its link sets it on arrival
    # to its own time.time() + timeout_s, which the engine's expiry compares against.
    deadline: float | None = None
    # Structured output: llguidance's JSON grammar, built and validated by the gateway
    # (gateway/prompt/structured.py); the worker masks every choice's tokens with it. None: free
    # text.
    grammar: str | None = None
    # W3C trace context ("00-<trace id>-<span id>-<flags>") of the gateway's request span, so the
    # worker's span joins the same trace; None when tracing is off.
    traceparent: str | None = None
    # The prefix cache's tenant: blocks are shared only between requests with the same salt
    # (the gateway derives it from the API key and the request's own cache_salt). "": shared.
    cache_salt: str = ""
    # An embedding request: the prompt is `input_lengths` inputs laid end to end (params.n of
    # them), each pooled by the worker's --pooling into one normalised vector; nothing is
    # generated. Input i's vector comes back as choice i's only frame.
    embed: bool = False
    input_lengths: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class TokenOutput:
    """New tokens for one choice of one request. `finish_reason` set on its last frame."""

    request_id: str
    index: int  # choice index, 0..n-1
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0  # tokens of this choice so far
    logprobs: list[LogprobEntry] | None = None  # one entry per new token
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # On a request's first token frame only: seconds from the start of the engine step that
    # first scheduled the request to the sending of this frame. The gateway subtracts it from
    # its time to first token to get the queue wait (arrival to first scheduled).
    since_scheduled_s: float | None = None
    # An embedding request's input `index`: its vector, float32 little-endian (finish "stop").
    embedding: bytes | None = None


@dataclass(frozen=True)
class StepOutputs:
    """Every TokenOutput of one engine step (or of one abort), in one message: a worker running
    64 sequences at 50 steps a second sends 50 messages a second, not 3,200. On the wire each
    output is a positional list in TokenOutput's field order (protocol.codec), not a map."""

    outputs: list[TokenOutput]


@dataclass(frozen=True)
class RequestError:
    request_id: str
    message: str
    code: str = "engine_error"  # "invalid_request" for refusals the client caused


@dataclass(frozen=True)
class Cancel:
    request_id: str
    # None: the whole request. An index: only that choice (n > 1: it hit a stop string at the
    # gateway while its siblings go on). Optional, so peers without it still understand.
    index: int | None = None


@dataclass(frozen=True)
class Heartbeat:
    worker_id: str
    stats: Stats
    time: float = 0.0
    draining: bool = False  # shutting down: finishing what it has, taking nothing new
    # Nothing may come from the worker for this long from now: it is about to run work that
    # holds the GIL, so its I/O thread cannot send (llguidance building its tokenizer for the
    # first grammar: 0.7 s for a 151,936-token vocabulary on a quiet host). 0: beating as usual.
    quiet_s: float = 0.0


@dataclass(frozen=True)
class Reset:
    """Gateway -> worker: "I do not know you" (a gateway restart): say Hello again."""

    reason: str = ""


@dataclass(frozen=True)
class WorkerDying:
    worker_id: str
    reason: str


@dataclass(frozen=True)
class ProtocolError:
    """Answer to a frame that did not decode. Never fatal to either side."""

    message: str
