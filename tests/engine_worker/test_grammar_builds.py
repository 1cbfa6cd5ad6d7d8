"""engine_worker/grammar_builds.py: matchers built on a thread of their own, handed to the
engine loop when done; a request cancelled while it builds is forgotten; a failure is its own."""

from __future__ import annotations

import threading
import time

from engine_worker.grammar import GrammarError
from engine_worker.grammar_builds import GrammarBuilds
from protocol import messages as m


class SlowCompiler:
    def __init__(self) -> None:
        self.gate = threading.Event()
        self.built: list[str] = []

    def matchers(self, grammar: str, n: int) -> list[str]:
        self.gate.wait(5)
        if grammar == "bad":
            raise GrammarError("invalid grammar: bad")
        self.built.append(grammar)
        return [f"{grammar}#{i}" for i in range(n)]


def gen(rid: str, grammar: str, n: int = 1) -> m.Generate:
    return m.Generate(rid, [1, 2], m.SamplingParams(n=n), grammar=grammar)


def wait_ready(builds: GrammarBuilds, count: int) -> list:
    out: list = []
    for _ in range(200):
        out += builds.ready()
        if len(out) >= count:
            return out
        time.sleep(0.01)
    raise AssertionError(f"only {len(out)} of {count} built")


def test_a_build_runs_off_the_caller_and_is_handed_over_when_done() -> None:
    compiler = SlowCompiler()
    builds = GrammarBuilds(compiler)
    builds.start(gen("a", "g1", n=2))
    assert builds and builds.ready() == []  # the caller never waits for it
    compiler.gate.set()
    [(request, matchers)] = wait_ready(builds, 1)
    assert request.request_id == "a" and matchers == ["g1#0", "g1#1"]
    assert not builds


def test_a_cancelled_build_is_forgotten_and_an_error_is_the_requests_own() -> None:
    compiler = SlowCompiler()
    builds = GrammarBuilds(compiler)
    builds.start(gen("a", "g1"))
    builds.start(gen("b", "g2"))
    builds.start(gen("c", "bad"))
    assert builds.drop("b") and not builds.drop("nobody")
    compiler.gate.set()
    done = dict((r.request_id, got) for r, got in wait_ready(builds, 2))
    assert done["a"] == ["g1#0"] and isinstance(done["c"], GrammarError)
    assert "b" not in done and not builds
