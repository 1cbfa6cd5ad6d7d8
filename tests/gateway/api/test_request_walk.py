"""The walk one request takes through the gateway's code: how often it comes back to a file.

One non-streamed /v1/chat/completions request runs through the real Starlette app in-process
(httpx's ASGITransport, so the app runs on this thread) against a fake engine worker
(tests/gateway/fake_engine.py). sys.setprofile (and threading.setprofile, for the tokenizing
thread) records every Python "call" event whose code lives in a file under gateway/, from the
moment the route's handler is entered until it returns its Response: pydantic and Starlette are
not counted, every gateway module is, small helpers and properties included. The files form a
sequence (consecutive repeats collapsed); a "return" is an entry into a file the walk had
visited before and left.

Two walks are counted:
- the route's walk: the functions of gateway/api/exchange.py (the request's lifecycle, which
  gateway/api/routes.py hands each request to) and those its code calls, each counted
  when entered from another file (a resumed coroutine continues a stop already made, and a
  method calling another of the same file stays in the file the reader has open; neither is a
  new stop). This is the path a reader follows from the handler: intake -> admit -> route ->
  stream should read one way. At most MAX_RETURNS (15 before issue 24's refactor, 8 after;
  counted as above from issue 38 on: 8 before its Exchange, 7 after, although the walk now
  also sees the generation's start and its close with the slot's release, which moved out of
  admit.start and Generation.close into the exchange).
- the full walk: every call event at any depth, coroutine resumptions and the three token
  frames included, each thread's calls in their own order. It is dominated by nested helpers
  and by the per-token loop (generation -> detokenize -> tokenizer -> formatter, once a frame),
  so it is held to what it is now (FULL_WALK_RETURNS) rather than to the route's bound.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from types import FrameType
from typing import Any

import httpx
from starlette.responses import Response
from starlette.routing import Route

import gateway
from gateway.api.app import create_app
from gateway.config import GatewayConfig
from gateway.tokens.tokenizer import GatewayTokenizer
from protocol import messages as m
from tests.gateway.fake_engine import FakeEngine

GATEWAY_DIR = os.path.dirname(os.path.abspath(gateway.__file__)) + os.sep
ROUTES_FILE = os.path.join("api", "exchange.py")  # the route's way (issue 38: one Exchange)
MAX_RETURNS = 7  # the route's walk
# The full walk: 112 before issue 24's refactor, 89 after (with the tokenizing thread's calls
# interleaved as they fell, 89-96 by the machine's load); 97 since issue 36's admission by the
# work admitted (backlog.py, entered at admission, after tokenizing and at the end), each thread's
# calls now counted in their own order; 99 before issue 38's Exchange, 97 after; 98 since issue
# 55's one admission sequence (Exchange._admitted checks the fit inside the large-body hold, so
# heavy.py is left once more after admit.py).
FULL_WALK_RETURNS = 98


def collapse(files: list[str]) -> list[str]:
    return [f for i, f in enumerate(files) if i == 0 or files[i - 1] != f]


def count_returns(files: list[str]) -> int:
    """Entries into a file already visited and left (the sequence is collapsed first)."""
    seen: set[str] = set()
    returns = 0
    for f in collapse(files):
        returns += f in seen
        seen.add(f)
    return returns


def test_count_returns() -> None:
    assert count_returns(["a", "a", "b", "b", "c"]) == 0
    assert count_returns(["a", "b", "a", "c", "b", "a"]) == 3


class WalkRecorder:
    """The gateway calls between the handler's entry and its Response, each as (file, whether
    the frame is entered for the first time, the file of its caller)."""

    def __init__(self, handler: Any) -> None:
        self.handler_code = getattr(handler, "func", handler).__code__  # a partial's function
        self.calls: list[tuple[str, bool, str, int]] = []  # ... and the calling thread
        self._frames: list[FrameType] = []  # held, so that a frame's id is never reused
        self._seen: set[int] = set()
        self.active = False
        self.done = False

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        code = frame.f_code
        if event == "call":
            if not self.active and not self.done and code is self.handler_code:
                self.active = True
            if self.active and code.co_filename.startswith(GATEWAY_DIR):
                fresh = id(frame) not in self._seen
                if fresh:
                    self._seen.add(id(frame))
                    self._frames.append(frame)
                caller = frame.f_back.f_code.co_filename if frame.f_back is not None else ""
                self.calls.append((code.co_filename[len(GATEWAY_DIR):], fresh,
                                   caller[len(GATEWAY_DIR):] if caller.startswith(GATEWAY_DIR)
                                   else "", threading.get_ident()))
        elif event == "return" and self.active and code is self.handler_code \
                and isinstance(arg, Response):  # a coroutine that only suspends returns no Response
            self.active = False
            self.done = True

    def full_walk(self) -> list[str]:
        """Each thread's calls in order, the event loop's first: how the tokenizing thread's
        calls fall between the loop's depends on the machine's load, not on the code."""
        threads = list(dict.fromkeys(t for *_, t in self.calls))
        return [f for t in threads for f, _, _, ct in self.calls if ct == t]

    def route_walk(self) -> list[str]:
        return [f for f, fresh, caller, _ in self.calls
                if fresh and ROUTES_FILE in (f, caller) and f != caller]


def walk_chat_request(info: m.TokenizerInfo,
                      tokenizer: GatewayTokenizer) -> tuple[WalkRecorder, httpx.Response]:
    app = create_app(GatewayConfig())
    FakeEngine(app.state.gateway.client, info, tokenizer)
    [route] = [r for r in app.routes if isinstance(r, Route) and r.path == "/v1/chat/completions"]
    recorder = WalkRecorder(route.endpoint)
    body = {"model": "tiny", "max_tokens": 3,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]}

    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            # A model's first request builds its admission queue (gateway.admission.queue) and
            # compiles its chat template (once a process: the walk counted 98 returns where no
            # earlier test had, 93 where one had, so the test passed or failed by its order).
            # The walk is a later request's, as most are.
            first = await http.post("/v1/chat/completions", json=body)
            assert first.status_code == 200, first.text
            threading.setprofile(recorder.profile)
            sys.setprofile(recorder.profile)
            try:
                return await http.post("/v1/chat/completions", json=body)
            finally:
                sys.setprofile(None)
                threading.setprofile(None)  # type: ignore[arg-type]

    resp = asyncio.run(run())
    assert recorder.done
    return recorder, resp


def test_one_chat_request_walks_the_gateway_one_way(smollm2_info: m.TokenizerInfo,
                                                    smollm2: GatewayTokenizer) -> None:
    recorder, resp = walk_chat_request(smollm2_info, smollm2)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 3
    route, full = recorder.route_walk(), recorder.full_walk()
    for walk in (route, full):
        assert {ROUTES_FILE, "prompt/intake.py", "admission/admit.py", "output/formatters.py",
                "telemetry/accounting.py"} <= set(walk)
    # the thread's calls count
    assert "engine/engine_client.py" in full and "tokens/tokenizer.py" in full
    returns = count_returns(route)
    assert returns <= MAX_RETURNS, f"{returns} returns: {' -> '.join(collapse(route))}"
    full_returns = count_returns(full)
    assert full_returns <= FULL_WALK_RETURNS, \
        f"{full_returns} returns: {' -> '.join(collapse(full))}"


if __name__ == "__main__":  # prints the walks: python -m tests.gateway.api.test_request_walk
    import json

    from tests.gateway.conftest import INFO_FILE

    cache = os.environ.get("KESTREL_CACHE_DIR") or os.path.expanduser("~/.cache/kestrel")
    with open(os.path.join(cache, INFO_FILE), encoding="utf-8") as fh:
        info = m.TokenizerInfo(**json.load(fh)["info"])
    recorder, _ = walk_chat_request(info, GatewayTokenizer.from_info(info))
    for name, walk in (("route", recorder.route_walk()), ("full", recorder.full_walk())):
        stops = collapse(walk)
        print(f"{name} walk: {len(stops)} stops, {len(set(stops))} files, "
              f"{count_returns(walk)} returns")
        print(" -> ".join(stops))
