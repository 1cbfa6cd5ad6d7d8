"""Vetting a worker's Hello, off the link's receive loop (every slow step runs in a thread).

    frames ──decode (thread)──▶ check_hello (bounds) ──tokenizer digest (thread)──▶
    registry.refuse_reason (limits, same tokenizer as the model's) ──▶ for a new model only:
    build its tokenizer (thread; seconds for a large one) ──▶ refuse_reason again (another
    worker may have registered the model meanwhile) ──▶ Vetted, or a refusal reason

The caller (gateway.membership) sends the Welcome or the refusal and admits the worker.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from gateway import offload
from gateway.registry import Registry, check_hello
from gateway.tokenizer import GatewayTokenizer
from protocol import codec
from protocol import messages as m

log = logging.getLogger("kestrel.gateway.engine")
_EMPTY_TOKENIZER = m.TokenizerInfo("", None, None, None, [])


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
            tokenizer = await offload.run("hello", GatewayTokenizer.from_info, hello.tokenizer)
        except Exception as exc:  # the peer's data, not our bug: one line, no traceback
            reason = f"tokenizer did not load: {type(exc).__name__}"
            log.debug("tokenizer of a Hello for %s: %s: %s", hello.model_id,
                      type(exc).__name__, str(exc)[:300])
        else:
            reason = registry.refuse_reason(hello, digest)
    if reason is not None:
        return Refused("for " + hello.model_id, reason)
    return Vetted(replace(hello, tokenizer=_EMPTY_TOKENIZER), digest, tokenizer)
