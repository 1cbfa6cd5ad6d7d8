"""Issue 55: the link the worker loop drives is one Protocol (link_surface.py), met by the real
WorkerLink, the LinkSet of a gateway's several API server processes, and this suite's fake: a
member the loop uses that one of them lacks, or takes with other parameters, fails here (the
loop read the link's `hello` and `quiet` with getattr, and a LinkSet has no `hello`)."""

from __future__ import annotations

import inspect
from collections.abc import Iterator

import pytest

from engine_worker.link import WorkerLink
from engine_worker.link_set import LinkSet
from engine_worker.link_surface import LinkSurface
from protocol import messages as m
from tests.engine_worker.test_worker_link import FakeLink

MEMBERS = [name for name, value in vars(LinkSurface).items()
           if not name.startswith("_") and (callable(value) or isinstance(value, property))]
ATTRIBUTES = list(LinkSurface.__annotations__)
TOK = m.TokenizerInfo("{}", None, None, None, [0])


def test_the_surface_names_what_the_loop_uses() -> None:
    assert set(MEMBERS) == {"worker_id", "rejected", "start", "stop", "open_outbound", "forget",
                            "reset_scope", "quiet"}
    assert set(ATTRIBUTES) == {"inbound", "cancel_arrivals", "stats", "draining"}


@pytest.fixture
def links() -> Iterator[dict[str, object]]:
    """One of each, built and never started (no thread, no connection made)."""
    hello = m.Hello(m.PROTOCOL_VERSION, "w-abc", "tiny", 64, 64, 4, TOK)
    pair = [WorkerLink(f"tcp://127.0.0.1:{port}", hello, 0.25) for port in (1, 2)]
    yield {"WorkerLink": pair[0], "LinkSet": LinkSet(pair), "FakeLink": FakeLink()}
    for link in pair:
        link.stop()


@pytest.mark.parametrize("kind", ["WorkerLink", "LinkSet", "FakeLink"])
def test_each_link_meets_the_surface(links: dict[str, object], kind: str) -> None:
    link = links[kind]
    for name in MEMBERS + ATTRIBUTES:
        assert hasattr(link, name), f"{kind} has no {name}"
        want, got = vars(LinkSurface).get(name), getattr(type(link), name, None)
        if callable(want) and not isinstance(want, property):
            assert list(inspect.signature(got).parameters)[1:] == \
                list(inspect.signature(want).parameters)[1:], (kind, name)


def test_a_link_set_names_the_worker_its_links_announce(links: dict[str, object]) -> None:
    assert links["LinkSet"].worker_id == links["WorkerLink"].worker_id == "w-abc"  # type: ignore
