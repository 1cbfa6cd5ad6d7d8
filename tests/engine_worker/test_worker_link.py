"""The worker's link and loop glue, without a model: cancels after the end, remaining-time
deadlines on a clock that runs ahead, one Hello however many Resets, stale frames dropped.

Uses the simulated engine (no torch) and a real WorkerLink against a ROUTER the test plays.
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import zmq

from engine_worker import link as link_module
from engine_worker.link import WorkerLink, local_deadline
from engine_worker.main import WorkerLoop
from engine_worker.sim_engine import CostModel, SimEngine
from protocol import codec
from protocol import messages as m
from tests.procs import free_port

TOK = m.TokenizerInfo("{}", None, None, None, [0])


def sim_engine() -> SimEngine:
    return SimEngine(4, 1024, 16, 256, CostModel(0.0, 0.0, 0.0))


class FakeLink:
    """The loop's link (engine_worker/link_surface.py) in memory: frames sent are kept."""

    worker_id = "fake"

    def __init__(self) -> None:
        self.inbound: queue.Queue = queue.Queue()
        self.cancel_arrivals: dict[str, float] = {}
        self.sent: list = []
        self.rejected = None
        self.draining = False
        self.stats = m.Stats()

    def start(self) -> None:
        pass

    def stop(self, dying_reason: str | None = None, timeout: float = 2.0) -> None:
        pass

    def forget(self, request_id: str) -> None:
        pass

    def reset_scope(self, msg: m.Reset, request_ids: object) -> list[str]:
        return []

    def quiet(self, seconds: float, wait_s: float = 1.0) -> None:
        pass

    def open_outbound(self) -> FakeLink:
        return self

    def send(self, msg: object) -> None:
        self.sent.append(msg)


class Cfg:
    drain_timeout_s = 1.0
    otlp_endpoint = ""


def test_a_cancel_after_the_request_ended_leaves_nothing_behind() -> None:
    engine, link = sim_engine(), FakeLink()
    loop = WorkerLoop(Cfg(), engine, link, threading.Event())  # type: ignore[arg-type]
    loop._handle(m.Generate("r1", [1, 2, 3], m.SamplingParams(max_tokens=2)))
    while engine.has_work:
        loop._send_all(engine.step())
    for rid in ("r1", "never-seen"):  # ended before its Cancel; or never here at all
        link.cancel_arrivals[rid] = time.monotonic()  # what the I/O thread records
        loop._handle(m.Cancel(rid))
    assert link.cancel_arrivals == {}


def test_a_cancel_of_a_running_request_is_logged_then_forgotten() -> None:
    engine, link = sim_engine(), FakeLink()
    loop = WorkerLoop(Cfg(), engine, link, threading.Event())  # type: ignore[arg-type]
    loop._handle(m.Generate("r1", [1, 2, 3], m.SamplingParams(max_tokens=50)))
    loop._send_all(engine.step())
    link.cancel_arrivals["r1"] = time.monotonic()
    loop._handle(m.Cancel("r1"))
    assert link.cancel_arrivals == {} and link.sent[-1].outputs[-1].finish_reason == "abort"


def test_one_step_of_many_sequences_leaves_as_one_message() -> None:
    engine, link = sim_engine(), FakeLink()
    loop = WorkerLoop(Cfg(), engine, link, threading.Event())  # type: ignore[arg-type]
    for i in range(3):
        loop._handle(m.Generate(f"r{i}", [1, 2, 3], m.SamplingParams(max_tokens=5, n=1)))
    loop._send_all(engine.step())
    loop._send_all(engine.step())
    assert [type(msg) for msg in link.sent] == [m.StepOutputs, m.StepOutputs]
    assert [[o.request_id for o in msg.outputs] for msg in link.sent] == [["r0", "r1", "r2"]] * 2
    loop._send_all([])  # a step that produced nothing sends nothing
    assert len(link.sent) == 2


def test_the_simulated_worker_loop_goes_idle_and_takes_a_per_choice_cancel() -> None:
    """WorkerLoop.run calls check_idle as it goes idle and abort_choice for an n > 1 stop
    string: the simulated engine has both, so kestrel-sim-worker no longer exits on them."""
    engine, link = SimEngine(4, 1024, 16, 256, CostModel(0.01, 0.0, 0.0)), FakeLink()
    link.inbound = queue.Queue()
    stop = threading.Event()
    loop = WorkerLoop(Cfg(), engine, link, stop)  # type: ignore[arg-type]
    link.inbound.put(m.Generate("r1", [1, 2, 3], m.SamplingParams(max_tokens=50, n=2)))
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(loop.run()))
    thread.start()
    time.sleep(0.1)  # r1 is 10 of its 50 steps in
    link.inbound.put(m.Cancel("r1", 1))
    link.inbound.put(m.Generate("r2", [4], m.SamplingParams(max_tokens=3)))
    deadline = time.monotonic() + 10
    while (engine.has_work or len(link.sent) < 10) and time.monotonic() < deadline:
        time.sleep(0.05)  # r2 ends, r1's choice 0 runs out: the loop goes idle
    time.sleep(0.1)
    stop.set()
    thread.join(10)
    finishes = {(o.request_id, o.index): o.finish_reason for msg in link.sent
                for o in msg.outputs if o.finish_reason}
    assert result == [0] and not engine.has_work
    assert finishes == {("r1", 0): "length", ("r1", 1): "abort", ("r2", 0): "length"}


def test_a_deadline_is_remaining_time_so_a_clock_ahead_times_nothing_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    real = time.time
    monkeypatch.setattr(link_module.time, "time", lambda: real() + 3600)  # an hour ahead
    gen = local_deadline(m.Generate("r1", [1, 2], m.SamplingParams(), timeout_s=30.0))
    assert gen.deadline is not None and abs(gen.deadline - (real() + 3630)) < 1
    engine = sim_engine()
    engine.add(gen)
    assert engine.expired(real() + 3600) == []  # the worker's own now: 30 s left
    assert engine.expired(real() + 3631) == ["r1"]
    assert local_deadline(m.Generate("r2", [1], m.SamplingParams())).deadline is None


class FakeGateway:
    def __init__(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{free_port()}"
        self.sock.bind(self.address)

    def recv(self, timeout_s: float) -> tuple[bytes, object] | None:
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        identity, *body = self.sock.recv_multipart()
        return identity, codec.decode(body)

    def send(self, identity: bytes, msg: object) -> None:
        self.sock.send_multipart([identity, *codec.encode(msg)])


@contextmanager
def welcomed_link() -> Iterator[tuple[FakeGateway, WorkerLink, bytes]]:
    """A real WorkerLink (heartbeats 10 s apart) that this test's gateway has welcomed; the
    gateway, the link and the link's routing id."""
    gw = FakeGateway()
    hello = m.Hello(m.PROTOCOL_VERSION, uuid.uuid4().hex, "x", 64, 64, 1, TOK)
    link = WorkerLink(gw.address, hello, heartbeat_s=10.0)
    link.start()
    try:
        got = gw.recv(10)
        assert got is not None and isinstance(got[1], m.Hello)
        gw.send(got[0], m.Welcome(m.PROTOCOL_VERSION, True))
        assert link.welcomed.wait(5)
        yield gw, link, got[0]
    finally:
        link.stop()
        gw.sock.close()


def test_resets_in_a_burst_get_one_hello_and_stale_frames_are_dropped() -> None:
    with welcomed_link() as (gw, link, identity):
        for _ in range(200):  # a restarted gateway answering each queued frame
            gw.send(identity, m.Reset("unknown worker: say hello"))
        out = link.open_outbound()
        time.sleep(0.3)
        for i in range(20):  # the engine's frames for the old gateway's requests
            out.send(m.StepOutputs([m.TokenOutput(f"old-{i}", 0, [5])]))
        seen = []
        while (item := gw.recv(1.0)) is not None:
            seen.append(type(item[1]))
        assert seen.count(m.Hello) == 1 and m.StepOutputs not in seen
        resets = [msg for msg in list(link.inbound.queue) if isinstance(msg, m.Reset)]
        assert len(resets) == 1  # the engine aborts its requests once
        out.close()


def test_a_silence_is_announced_in_a_heartbeat_sent_before_quiet_returns() -> None:
    """WorkerLink.quiet: the heartbeat saying so leaves at once (not at the next beat, 10 s
    away here) and before the caller goes on to hold the GIL; the beats before it say nothing."""
    with welcomed_link() as (gw, link, _):
        while (item := gw.recv(0.3)) is not None:  # the first beat, on welcome
            assert isinstance(item[1], m.Heartbeat) and item[1].quiet_s == 0.0
        t0 = time.monotonic()
        link.quiet(7.5)
        returned = time.monotonic() - t0
        item = gw.recv(2.0)  # sent when quiet() returned
        assert item is not None and isinstance(item[1], m.Heartbeat), item
        assert item[1].quiet_s == 7.5 and returned < 1.0
