"""engine_worker/link_set.py: a worker joined to K gateway processes sends each request's frames
back to the gateway that sent it, and a Reset from one gateway ends only that gateway's requests.
The links are small fakes with WorkerLink's surface; the e2e test runs real ones."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from engine_worker.config import WorkerConfig
from engine_worker.link_set import LinkReset, LinkSet
from engine_worker.main import WorkerLoop
from protocol import messages as m


class FakeOut:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, msg: Any) -> None:
        self.sent.append(msg)

    def close(self) -> None:
        pass


class FakeLink:
    """One WorkerLink of a LinkSet, in memory."""

    hello = m.Hello(m.PROTOCOL_VERSION, "w1", "tiny", 64, 64, 4,
                    m.TokenizerInfo("{}", None, None, None, [0]))

    def __init__(self) -> None:
        self.inbound: Any = None
        self.cancel_arrivals: dict[str, float] = {}
        self.out = FakeOut()
        self.rejected = None
        self.stats = m.Stats()
        self.draining = False

    def open_outbound(self) -> FakeOut:
        return self.out


def gen(rid: str, n: int = 1) -> m.Generate:
    return m.Generate(rid, [1, 2], m.SamplingParams(n=n))


def test_frames_go_back_to_the_gateway_each_request_came_from() -> None:
    a, b = FakeLink(), FakeLink()
    links = LinkSet([a, b])  # type: ignore[list-item]
    a.inbound.put(gen("from-a"))
    b.inbound.put(gen("from-b", n=2))
    assert [links.inbound.get_nowait().request_id for _ in range(2)] == ["from-a", "from-b"]
    out = links.open_outbound()
    out.send(m.StepOutputs([m.TokenOutput("from-a", 0, [5]), m.TokenOutput("from-b", 0, [6]),
                            m.TokenOutput("from-b", 1, [7]), m.TokenOutput("stranger", 0, [8])]))
    assert [[o.request_id for o in s.outputs] for s in a.out.sent] == [["from-a"]]
    assert [[(o.request_id, o.index) for o in s.outputs] for s in b.out.sent] == [
        [("from-b", 0), ("from-b", 1)]]
    out.send(m.RequestError("from-a", "refused"))
    assert isinstance(a.out.sent[-1], m.RequestError) and len(b.out.sent) == 1
    # A request is forgotten once every choice has finished: n = 2 needs two finishes.
    out.send(m.StepOutputs([m.TokenOutput("from-b", 0, [9], "length")]))
    assert "from-b" in links.origin
    out.send(m.StepOutputs([m.TokenOutput("from-b", 1, [9], "stop")]))
    assert links.origin == {}


def test_a_reset_ends_only_the_requests_of_the_gateway_that_sent_it() -> None:
    a, b = FakeLink(), FakeLink()
    links = LinkSet([a, b])  # type: ignore[list-item]
    for link, rid in ((a, "a1"), (b, "b1"), (a, "a2")):
        link.inbound.put(gen(rid))
    b.inbound.put(m.Reset("gateway b restarted"))
    msgs = [links.inbound.get_nowait() for _ in range(4)]
    reset = msgs[-1]
    assert isinstance(reset, LinkReset) and reset.origin == 1
    assert links.reset_scope(reset, ["a1", "b1", "a2"]) == ["b1"]


def test_stats_and_draining_reach_every_link_and_a_refusal_from_any_is_seen() -> None:
    a, b = FakeLink(), FakeLink()
    links = LinkSet([a, b])  # type: ignore[list-item]
    links.stats = m.Stats(running=3)
    links.draining = True
    assert a.stats.running == b.stats.running == 3 and a.draining and b.draining
    assert links.rejected is None
    b.rejected = "protocol version mismatch"
    assert links.rejected == "protocol version mismatch"


class BlockedCompiler:
    """A grammar compiler whose builds never end while the test runs."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def matchers(self, grammar: str, n: int) -> list[Any]:
        self.release.wait(5)
        return []


class IdleEngine:
    """The engine surface WorkerLoop's message handling touches, with nothing running."""

    def __init__(self) -> None:
        self.grammars = BlockedCompiler()
        self.requests: dict[str, Any] = {}

    def abort(self, request_id: str, reason: str) -> list[m.TokenOutput]:
        return []  # never reached the engine: nothing to end


@pytest.mark.parametrize("end", ["cancel", "reset"])
def test_a_request_ended_while_its_grammar_builds_leaves_no_origin_behind(end: str) -> None:
    a, b = FakeLink(), FakeLink()
    links = LinkSet([a, b])  # type: ignore[list-item]
    engine = IdleEngine()
    loop = WorkerLoop(WorkerConfig(), engine, links, threading.Event())
    try:
        a.inbound.put(m.Generate("with-grammar", [1, 2], m.SamplingParams(),
                                 grammar='{"grammars": []}'))
        loop._drain_inbound(block=False)
        assert "with-grammar" in links.origin and loop.builds and "with-grammar" in \
            loop.builds.pending
        a.inbound.put(m.Cancel("with-grammar") if end == "cancel" else m.Reset("gateway restart"))
        loop._drain_inbound(block=False)
        assert not loop.builds and links.origin == {}
    finally:
        engine.grammars.release.set()
