"""The workers and models the gateway knows: who joined, what each may be sent, what it said.

    Hello ──check_hello (bounds; never trusted as sent)──▶ admit_worker ──▶ workers[identity]
                                                                       └──▶ models[model_id]
    a lost worker ──drop──▶ its requests are the caller's to fail or retry; a model no worker
                            serves any more is forgotten

A worker is shown to the outside (health, metric labels, log lines) only as `name`, an opaque
"w<index>" the gateway assigns: its worker id is also its ZeroMQ routing id, which must not leak.
A model's tokenizer comes from the first worker that registers it; a later worker of the same
model must bring the same tokenizer (same digest) or it is refused. The model's max_model_len is
the largest of its workers'; the router sends a request only to a worker whose own limit fits it.
"""

from __future__ import annotations

import itertools
import logging
import math
import re
import time
from dataclasses import dataclass, field, replace

from gateway.tokens.tokenizer import GatewayTokenizer
from protocol import messages as m

log = logging.getLogger("kestrel.gateway.engine")

# Bounds on what a Hello may claim. A worker is authenticated (CURVE) but still not trusted to
# size the gateway: these keep one bad or buggy worker from inflating admission or metrics.
MAX_WORKERS = 256
# The longest silence a worker may announce in one heartbeat (Heartbeat.quiet_s): a hung worker
# that said it would be quiet is still lost, this much later.
MAX_QUIET_S = 30.0
MAX_MODELS = 16
MAX_NUM_SEQS = 1024
MAX_MODEL_LEN = 1 << 20
MAX_KV_TOKENS = 1 << 30
MAX_PLAN_CHARS = 2048  # a worker's matmul plan line, shown by /health
_MODEL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")
_SHORT = re.compile(r"^[A-Za-z0-9._:+-]{0,32}$")
_WORKER_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def check_hello(hello: m.Hello) -> str | None:
    """Why this Hello is refused, or None. Strings that reach labels or logs are bounded."""
    if hello.protocol_version != m.PROTOCOL_VERSION:
        return (f"protocol version mismatch: worker speaks {hello.protocol_version}, "
                f"gateway speaks {m.PROTOCOL_VERSION}")
    if not _MODEL_ID.match(hello.model_id):
        return "model_id must be 1-128 of [A-Za-z0-9._:/@+-]"
    if len(hello.aliases) > 8 or not all(_MODEL_ID.match(a) for a in hello.aliases):
        return "aliases: at most 8, each like a model_id"
    if not _WORKER_ID.match(hello.worker_id):
        return "worker_id must be 1-64 of [A-Za-z0-9._-]"
    for name in ("device", "dtype", "quantization", "kv_cache_dtype"):
        if not _SHORT.match(getattr(hello, name)):
            return f"{name} must be at most 32 of [A-Za-z0-9._:+-]"
    if len(hello.matmul_plan) > MAX_PLAN_CHARS or not hello.matmul_plan.isprintable():
        return f"matmul_plan must be at most {MAX_PLAN_CHARS} printable characters"
    bounds = {"max_model_len": (1, MAX_MODEL_LEN), "max_num_seqs": (1, MAX_NUM_SEQS),
              "kv_capacity_tokens": (0, MAX_KV_TOKENS), "block_size": (1, 4096),
              "weight_bytes": (0, 1 << 50), "decode_read_bytes": (0, 1 << 50),
              "kv_bytes_per_token": (0, 1 << 40)}
    for name, (low, high) in bounds.items():
        value = getattr(hello, name)
        if not low <= value <= high:
            return f"{name}={value} is outside [{low}, {high}]"
    return None


@dataclass
class WorkerState:
    identity: bytes
    hello: m.Hello
    index: int  # assigned by the gateway; never reused within its life
    last_seen: float
    stats: m.Stats = field(default_factory=m.Stats)
    inflight: set[str] = field(default_factory=set)
    # The sequences of those requests (each its n), kept as they come and go: a step's frame
    # is checked against it, so it must cost O(1), not a walk over the requests in flight.
    sequences: int = 0
    ready: bool = False
    draining: bool = False
    # Sequences its last heartbeat counted beyond ours (another gateway's, with several API
    # server processes); see load.
    others: int = 0
    # When it sent frames no honest worker sends (EngineClient._refuse), within a window.
    faults: list[float] = field(default_factory=list)
    # Until when its silence is not counted: it said it would be quiet (Heartbeat.quiet_s).
    quiet_until: float = 0.0
    quiet_logged: float = -3600.0  # when that was last logged: once a minute at most

    @property
    def name(self) -> str:
        """The only name shown outside the gateway (health, metrics, logs)."""
        return f"w{self.index}"

    def take(self, request_id: str, n: int) -> None:
        """A request of n sequences is now ours in flight here."""
        if request_id not in self.inflight:
            self.inflight.add(request_id)
            self.sequences += n

    def forget(self, request_id: str, n: int) -> None:
        """That request ended here (idempotent)."""
        if request_id in self.inflight:
            self.inflight.discard(request_id)
            self.sequences -= n

    def forget_all(self) -> None:
        self.inflight.clear()
        self.sequences = 0

    @property
    def capacity(self) -> int:
        return self.hello.max_num_seqs

    @property
    def load(self) -> int:
        """Sequences it holds: ours, counted as they are sent and end, plus what its last
        heartbeat counted beyond ours. Never the heartbeat's total alone: it is up to a beat
        old, and after a burst it still shows a worker full that has just emptied (the router
        then sent the next burst elsewhere: two workers served bursts at 0.72 of 2 x one)."""
        return len(self.inflight) + self.others

    def on_heartbeat(self, beat: m.Heartbeat) -> None:
        self.stats = beat.stats
        self.others = max(0, beat.stats.running + beat.stats.waiting - len(self.inflight))
        self.draining = beat.draining
        quiet = beat.quiet_s
        if not (math.isfinite(quiet) and quiet > 0):  # the codec made it a float
            self.quiet_until = 0.0  # beating as usual: its silence counts from its last frame
            return
        now = time.monotonic()
        if now - self.quiet_logged > 60:  # a rogue's beats must not fill the log
            self.quiet_logged = now
            log.info("worker %s may be silent for up to %.1f s (work that holds its GIL)",
                     self.name, min(quiet, MAX_QUIET_S))
        self.quiet_until = now + min(quiet, MAX_QUIET_S)

    def silent_for(self, now: float) -> float:
        """How long it has been silent, not counting a silence it announced."""
        return now - max(self.last_seen, self.quiet_until)


@dataclass
class ModelEntry:
    """A model some worker serves, with the tokenizer built from the Hello that registered it.
    `hello.max_model_len` is the largest over the model's workers (what a request may ask)."""

    model_id: str
    hello: m.Hello
    tokenizer: GatewayTokenizer
    digest: str
    created: int = field(default_factory=lambda: int(time.time()))
    # Token ids its workers may send are in range(vocab_size): the tokenizer's, added included.
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        if self.vocab_size is None:
            self.vocab_size = self.tokenizer.vocab_size


class Registry:
    def __init__(self) -> None:
        self.workers: dict[bytes, WorkerState] = {}
        self.models: dict[str, ModelEntry] = {}
        self._index = itertools.count(1)

    def ready_workers(self) -> list[WorkerState]:
        return [w for w in self.workers.values() if w.ready and not w.draining]

    def model(self, name: str) -> ModelEntry | None:
        """The model with this id, or with this alias (--served-model-name's later names)."""
        entry = self.models.get(name)
        if entry is None:
            entry = next((e for e in self.models.values() if name in e.hello.aliases), None)
        return entry

    def seats(self, model_id: str) -> int:
        """Sequences the model's ready workers run at once: its default admission limit."""
        return sum(w.hello.max_num_seqs for w in self.candidates(model_id))

    def worker_ids(self, model_id: str) -> list[str]:
        """The ids of the model's ready workers (their drain rates add up)."""
        return [w.hello.worker_id for w in self.candidates(model_id)]

    def candidates(self, model_id: str, need_len: int = 0) -> list[WorkerState]:
        """Ready workers of the model whose own context fits `need_len` tokens."""
        return [w for w in self.ready_workers()
                if w.hello.model_id == model_id and w.hello.max_model_len >= need_len]

    def refuse_reason(self, hello: m.Hello, digest: str) -> str | None:
        """Why a checked Hello cannot join now (limits, a different tokenizer), or None."""
        if len(self.workers) >= MAX_WORKERS:
            return f"the gateway already has {MAX_WORKERS} workers"
        entry = self.models.get(hello.model_id)
        if entry is None:
            if len(self.models) >= MAX_MODELS:
                return f"the gateway already serves {MAX_MODELS} models"
        elif entry.digest != digest:
            return (f"its tokenizer differs from the one model {hello.model_id!r} was "
                    f"registered with")
        if hello.tokenizer_digest and hello.tokenizer_digest != digest:
            return "its tokenizer_digest does not match the tokenizer it sent"
        return None

    def admit(self, identity: bytes, hello: m.Hello, digest: str,
              tokenizer: GatewayTokenizer | None) -> WorkerState:
        """Register a worker whose Hello passed; `tokenizer` is needed for a new model."""
        # The step costs it measured before saying Hello count from the first request on, not
        # from its first heartbeat: a burst right after it joins is estimated, not guessed.
        worker = WorkerState(identity, hello, next(self._index), time.monotonic(), ready=True,
                             stats=m.Stats(step_costs=hello.step_costs))
        self.workers[identity] = worker
        entry = self.models.get(hello.model_id)
        if entry is None:
            if tokenizer is None:
                raise ValueError("a new model needs its tokenizer")
            self.models[hello.model_id] = ModelEntry(hello.model_id, hello, tokenizer, digest)
        elif hello.max_model_len > entry.hello.max_model_len:
            entry.hello = replace(entry.hello, max_model_len=hello.max_model_len)
        return worker

    def drop(self, worker: WorkerState) -> bool:
        """Forget a worker (False if it was already gone) and any model left without one."""
        if self.workers.get(worker.identity) is not worker:
            return False
        del self.workers[worker.identity]
        for model_id, entry in list(self.models.items()):
            lens = [w.hello.max_model_len for w in self.workers.values()
                    if w.hello.model_id == model_id]
            if not lens:
                del self.models[model_id]
            elif max(lens) != entry.hello.max_model_len:
                entry.hello = replace(entry.hello, max_model_len=max(lens))
        return True
