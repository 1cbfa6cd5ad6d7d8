"""Grammar matchers built off the engine loop.

    Generate with a grammar ──start──▶ a builder thread compiles its matchers (one per choice)
    each loop turn ──ready()──▶ (request, matchers) ──▶ Engine.add(request, matchers), or
        (request, error) ──▶ a RequestError
    Cancel or Reset while it builds ──drop──▶ forgotten (its result is thrown away)

Building an llguidance matcher for a large schema takes long: ~0.5 s for a 540 KB grammar with
the tiny model's tokenizer (Ice Lake), and it releases the GIL meanwhile. Built on the engine
loop, it stalled every running sequence for that long, each time. The request waits here, not in
the scheduler, until its matchers exist.

The first build also builds llguidance's tokenizer, which holds the GIL (0.7 s for a 151,936-token
vocabulary on a quiet host, several times that on a busy one): the link's I/O thread sends no
heartbeat meanwhile, and a gateway that waits 1.5 s for one dropped the worker mid-request. So
the builder first has the link announce a silence (`before_first_build`: WorkerLink.quiet), which
the gateway does not count against the worker.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from protocol import messages as m

# The silence announced before llguidance's tokenizer is built: ~10x its build on a quiet host
# for the largest vocabulary we serve, so a busy 2-core host still fits in it.
TOKENIZER_BUILD_QUIET_S = 10.0


class GrammarBuilds:
    def __init__(self, compiler: Any,
                 before_first_build: Callable[[float], None] | None = None) -> None:
        self.compiler = compiler  # engine_worker.grammar.GrammarCompiler
        self.before_first_build = before_first_build  # given the silence to announce
        self.pending: dict[str, tuple[m.Generate, Future]] = {}
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def __bool__(self) -> bool:
        return bool(self.pending)

    def start(self, gen: m.Generate) -> None:
        if self._thread is None:  # a daemon: a build in progress never holds up an exit
            self._thread = threading.Thread(target=self._serve, name="grammar-build",
                                            daemon=True)
            self._thread.start()
        fut: Future = Future()
        self.pending[gen.request_id] = (gen, fut)
        self._jobs.put((gen, fut))

    def _serve(self) -> None:
        while True:
            gen, fut = self._jobs.get()
            if not fut.set_running_or_notify_cancel():
                continue  # dropped before it began
            try:
                if self.before_first_build is not None and not self.compiler.built:
                    self.before_first_build(TOKENIZER_BUILD_QUIET_S)
                fut.set_result(self.compiler.matchers(gen.grammar, max(1, gen.params.n)))
            except BaseException as exc:  # handed to the engine loop as this request's error
                fut.set_exception(exc)

    def ready(self) -> list[tuple[m.Generate, Any]]:
        """The requests whose build ended: (request, matchers) or (request, the exception)."""
        done = [rid for rid, (_, fut) in self.pending.items() if fut.done()]
        out = []
        for rid in done:
            gen, fut = self.pending.pop(rid)
            out.append((gen, fut.exception() or fut.result()))
        return out

    def drop(self, request_id: str) -> bool:
        """Forget a request still building (its Cancel came); False if it is not here."""
        entry = self.pending.pop(request_id, None)
        if entry is None:
            return False
        entry[1].cancel()  # not begun: never built; begun: its result is thrown away
        return True
