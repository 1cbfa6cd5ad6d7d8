"""Issue 38: the engine surface the worker loop drives is one Protocol (engine_surface.py), and
both engines meet it: the real Engine and the SimEngine (no torch). A method the loop calls that
one of them lacks, or takes with other parameters, fails here, not in a serving worker (the
SimEngine lacked pop_errors until it was added with it)."""

from __future__ import annotations

import inspect

import pytest

from engine_worker.engine import Engine
from engine_worker.engine_surface import EngineSurface
from engine_worker.sim_engine import CostModel, SimEngine

MEMBERS = [name for name, value in vars(EngineSurface).items()
           if not name.startswith("_") and (callable(value) or isinstance(value, property))]
ATTRIBUTES = list(EngineSurface.__annotations__)


def test_the_surface_names_what_the_loop_uses() -> None:
    assert set(MEMBERS) == {"has_work", "add", "abort", "abort_choice", "expired", "step",
                            "pop_errors", "stats", "check_idle"}
    assert set(ATTRIBUTES) == {"requests", "grammars"}


@pytest.mark.parametrize("engine", [Engine, SimEngine], ids=["Engine", "SimEngine"])
@pytest.mark.parametrize("name", MEMBERS)
def test_each_engine_meets_the_surface(engine: type, name: str) -> None:
    want, got = vars(EngineSurface)[name], getattr(engine, name, None)
    assert got is not None, f"{engine.__name__} has no {name}"
    if isinstance(want, property):
        assert isinstance(got, property), f"{engine.__name__}.{name} is not a property"
        return
    assert list(inspect.signature(got).parameters) == list(inspect.signature(want).parameters)
    for p_want, p_got in zip(inspect.signature(want).parameters.values(),
                             inspect.signature(got).parameters.values(), strict=True):
        assert p_got.default == p_want.default, (engine.__name__, name, p_got)


def test_a_simulated_engine_has_the_surfaces_attributes() -> None:
    sim = SimEngine(4, 1024, 16, 256, CostModel(0.0, 0.0, 0.0))
    for name in ATTRIBUTES:
        assert hasattr(sim, name), name
    assert sim.grammars is None and sim.requests == {}
