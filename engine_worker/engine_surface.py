"""The engine as the worker loop drives it: one Protocol, met by the real Engine (tensors) and
the SimEngine (a cost model, no torch), and checked against both in
tests/engine_worker/test_engine_surface.py, where a docstring used to promise it and the loop
probed it with getattr.

    WorkerLoop ──add / abort / abort_choice / expired──▶ engine
               ◀──step(): token frames; pop_errors(): requests it ended by itself──
               ──has_work, stats(), check_idle(), requests (ids in flight)──▶ its state
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from protocol import messages as m


class EngineSurface(Protocol):
    # request id -> its state; the loop reads only which ids are in flight, and how many
    requests: Mapping[str, Any]
    grammars: Any  # engine_worker.grammar.GrammarCompiler, or None: no structured output here

    @property
    def has_work(self) -> bool:
        """Something is queued or running."""
        ...

    def add(self, gen: m.Generate, matchers: list[Any] | None = None) -> None:
        """Queue a request (with its grammar's matchers, one a choice, built already); raises
        ValueError if it cannot be run."""
        ...

    def abort(self, request_id: str, reason: str = "abort") -> list[m.TokenOutput]:
        """Stop a request now; its closing frames (none if unknown)."""
        ...

    def abort_choice(self, request_id: str, index: int) -> list[m.TokenOutput]:
        """Stop one choice of a request that goes on."""
        ...

    def expired(self, now: float) -> list[str]:
        """Ids of the requests whose deadline (epoch seconds) has passed at `now`."""
        ...

    def step(self) -> list[m.TokenOutput]:
        """Run one step; its token frames."""
        ...

    def pop_errors(self) -> list[m.RequestError]:
        """The requests it ended by itself since the last call, each with its error."""
        ...

    def stats(self) -> m.Stats:
        ...

    def check_idle(self) -> list[str]:
        """With nothing in flight, what is still held (each a breach, logged)."""
        ...
