"""Issue 38: the link surface the gateway drives is one Protocol (gateway/engine/link.py's
LinkSurface), met by the ZeroMQ EngineLink and by the tests' in-memory LoopbackLink
(tests/gateway/fake_engine.py); a method the engine client or the membership calls that one of
them lacks, or takes with other parameters, fails here."""

from __future__ import annotations

import inspect

import pytest

from gateway.engine import engine_client, membership
from gateway.engine.link import EngineLink, LinkSurface
from tests.gateway.fake_engine import LoopbackLink

MEMBERS = [name for name, value in vars(LinkSurface).items()
           if not name.startswith("_") and callable(value)]


def test_the_surface_names_what_the_gateway_calls() -> None:
    assert set(MEMBERS) == {"bind", "close", "recv", "send", "next_disconnect"}
    # and the gateway's code calls nothing else of its link
    for module in (engine_client, membership):
        called = set(inspect.getsource(module).split("self.link.")[1:])
        names = {c.split("(")[0] for c in called}
        assert names <= set(MEMBERS), (module.__name__, names - set(MEMBERS))


@pytest.mark.parametrize("link", [EngineLink, LoopbackLink], ids=["EngineLink", "LoopbackLink"])
@pytest.mark.parametrize("name", MEMBERS)
def test_each_link_meets_the_surface(link: type, name: str) -> None:
    want, got = vars(LinkSurface)[name], getattr(link, name, None)
    assert got is not None, f"{link.__name__} has no {name}"
    assert inspect.iscoroutinefunction(got) == inspect.iscoroutinefunction(want), name
    assert list(inspect.signature(got).parameters) == list(inspect.signature(want).parameters)
