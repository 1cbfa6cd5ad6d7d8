"""Vetting a worker's Hello, off the link's receive loop (every slow step runs in a thread).

    frames ──decode (thread)──▶ check_hello (bounds) ──tokenizer digest (thread)──▶
    registry.refuse_reason (limits, same tokenizer as the model's) ──▶ for a new model only:
    its tokenizer, built lately (by digest) or now (thread; seconds for a large one) ──▶
    refuse_reason again (another worker may have registered the model meanwhile) ──▶ Vetted,
    or a refusal reason

The caller (gateway.engine.membership) sends the Welcome or the refusal and admits the worker.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, replace

from gateway import offload
from gateway.engine.registry import Registry, check_hello
from gateway.tokens.tokenizer import GatewayTokenizer
from protocol import codec
from protocol import messages as m

log = logging.getLogger("kestrel.gateway.engine")
_EMPTY_TOKENIZER = m.TokenizerInfo("", None, None, None, [])


class Built:
    """The tokenizers built lately, by digest: a worker that restarts (or a model's worker
    that left and comes back) is not built again. Building holds the GIL for part of its time
    (~0.15 s for a 3 MB tokenizer), which the event loop feels, and memory is not given back."""

    def __init__(self, keep: int = 4) -> None:
        self._keep = keep
        self._by_digest: OrderedDict[str, GatewayTokenizer] = OrderedDict()

    def get(self, digest: str) -> GatewayTokenizer | None:
        tokenizer = self._by_digest.get(digest)
        if tokenizer is not None:
            self._by_digest.move_to_end(digest)
        return tokenizer

    def keep(self, digest: str, tokenizer: GatewayTokenizer) -> None:
        self._by_digest[digest] = tokenizer
        self._by_digest.move_to_end(digest)
        while len(self._by_digest) > self._keep:
            self._by_digest.popitem(last=False)


BUILT = Built()


@dataclass(frozen=True)
class Vetted:
    hello: m.Hello  # without its tokenizer: no per-worker copy of megabytes
    digest: str
    tokenizer: GatewayTokenizer | None  # built only for a model not registered yet


@dataclass(frozen=True)
class Refused:
    who: str
    reason: str


async def vet_hello(registry: Registry, body: list[bytes]) -> Vetted | Refused:
    """Raises codec.DecodeError for frames that are not a Hello at all."""
    hello = await offload.run("hello", codec.decode, body)
    if not isinstance(hello, m.Hello):
        raise codec.DecodeError("not a Hello")
    reason = check_hello(hello)
    if reason is not None:
        return Refused("(unnamed)", reason)
    digest = await offload.run("hello", codec.tokenizer_digest, hello.tokenizer)
    reason = registry.refuse_reason(hello, digest)
    tokenizer = None
    if reason is None and hello.model_id not in registry.models:
        try:
            # (the digest reads an absent template as an empty one; they differ for chat)
            built = f"{digest}:{hello.tokenizer.chat_template is None}"
            tokenizer = BUILT.get(built) or await offload.run(
                "hello", GatewayTokenizer.from_info, hello.tokenizer)
        except Exception as exc:  # the peer's data, not our bug: one line, no traceback
            reason = f"tokenizer did not load: {type(exc).__name__}"
            log.debug("tokenizer of a Hello for %s: %s: %s", hello.model_id,
                      type(exc).__name__, str(exc)[:300])
        else:
            BUILT.keep(built, tokenizer)
            reason = registry.refuse_reason(hello, digest)
    if reason is not None:
        return Refused("for " + hello.model_id, reason)
    return Vetted(replace(hello, tokenizer=_EMPTY_TOKENIZER), digest, tokenizer)
