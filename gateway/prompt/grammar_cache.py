"""Compiled grammars by what they were built from, so a schema compiles once.

A client sends the same response_format or tools with every request: the first compiles it
(on the grammar pool, gateway/offload.py), the rest find it here, and those that arrive while it
still compiles wait for that one job instead of starting their own. Least recently used entries
go first; a grammar over `max_chars` is not kept. Failures are not kept either: each caller gets
its own error (a 400) and a retry compiles anew.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any


def grammar_key(kind: str, value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(f"{kind}\0{text}".encode("utf-8", "surrogatepass")).hexdigest()


class GrammarCache:
    def __init__(self, entries: int = 64, max_chars: int = 1 << 20) -> None:
        self.entries = entries
        self.max_chars = max_chars
        self._done: OrderedDict[str, str] = OrderedDict()
        self._pending: dict[str, asyncio.Future[str]] = {}

    async def get(self, kind: str, value: Any, build: Callable[[], Awaitable[str]]) -> str:
        key = grammar_key(kind, value)
        if key in self._done:
            self._done.move_to_end(key)
            return self._done[key]
        pending = self._pending.get(key)
        if pending is not None:
            return await asyncio.shield(pending)
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._pending[key] = fut
        try:
            grammar = await build()
        except BaseException as exc:
            if not fut.done():  # the waiters get the same error, then are free to retry
                fut.set_exception(exc if isinstance(exc, Exception) else RuntimeError(str(exc)))
            fut.exception()  # marked retrieved: no "never retrieved" warning without waiters
            raise
        finally:
            self._pending.pop(key, None)
        fut.set_result(grammar)
        if len(grammar) <= self.max_chars:
            self._done[key] = grammar
            while len(self._done) > self.entries:
                self._done.popitem(last=False)
        return grammar


CACHE = GrammarCache()
