"""A route that falls behind its worker takes the queued frames at once and sends one event for
them: one choice's consecutive token frames are joined (tokens, logprobs, the first frame's
timing), never across choices, never past a finish, and never when stop strings could end the
text inside a joined frame (the usage would then count tokens after the stop)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from gateway.engine.engine_client import EngineClient
from gateway.output.generation import ChoiceEvent, Generation
from gateway.tokens.tokenizer import GatewayTokenizer
from protocol import codec
from protocol import messages as m


def frame(index: int, token: int, k: int, finish: str | None = None,
          logprobs: bool = False) -> m.TokenOutput:
    lp = [[token, -0.5 - k, []]] if logprobs else None
    return m.TokenOutput("rid-1", index, [token], finish, 3, k + 1, lp,
                         since_scheduled_s=0.002 if k == 0 else None)


def generate(info: m.TokenizerInfo, tok: GatewayTokenizer, steps: list[list[m.TokenOutput]],
             stop: list[str], n: int = 1) -> tuple[list[ChoiceEvent], Generation]:
    """Every step's StepOutputs is dispatched before the route reads any: it is behind."""

    async def go() -> tuple[list[ChoiceEvent], Generation]:
        client = EngineClient("inproc://unused")
        hello = m.Hello(m.PROTOCOL_VERSION, "w", "tiny", 2048, 65536, 8, info)
        worker = client.registry.admit(b"w", hello, codec.tokenizer_digest(info), tok)

        async def send(identity: bytes, msg: Any) -> bool:
            return True

        client.link.send = send  # type: ignore[method-assign]
        now = time.monotonic()
        gen = Generation(client, client.models["tiny"], [1, 2, 3], m.SamplingParams(n=n), stop,
                         now + 30, now, request_id="rid-1")
        await gen.start()
        for step in steps:
            await client._dispatch(worker, m.StepOutputs(step))
        events = [event async for event in gen.events()]
        client.link.close()
        return events, gen

    return asyncio.run(go())


def test_frames_queued_behind_the_route_go_out_as_one_event(
        smollm2_info: m.TokenizerInfo, smollm2: GatewayTokenizer) -> None:
    ids = smollm2.encode(" Paris is the capital of France")
    steps = [[frame(0, t, k, "length" if k == len(ids) - 1 else None, logprobs=True)]
             for k, t in enumerate(ids)]
    events, gen = generate(smollm2_info, smollm2, steps, stop=[])
    assert len(events) == 1
    assert events[0].token_ids == ids and events[0].finish_reason == "length"
    assert [e[0] for e in events[0].logprobs or []] == ids
    assert events[0].text == smollm2.decode(ids, True)
    assert gen.completion_tokens == len(ids)
    assert gen.timings.since_scheduled_s == 0.002  # the first frame's


def test_choices_are_never_joined_with_each_other(
        smollm2_info: m.TokenizerInfo, smollm2: GatewayTokenizer) -> None:
    a, b = smollm2.encode(" one two three"), smollm2.encode(" four five six")
    steps = [[frame(0, a[k], k, "length" if k == 2 else None),
              frame(1, b[k], k, "length" if k == 2 else None)] for k in range(3)]
    events, gen = generate(smollm2_info, smollm2, steps, stop=[], n=2)
    assert [e.index for e in events] == [0, 1] * 3  # the steps interleave the two choices
    text = {i: "".join(e.text for e in events if e.index == i) for i in (0, 1)}
    assert text == {0: " one two three", 1: " four five six"}


def test_with_stop_strings_each_frame_is_its_own_event_and_the_usage_stops_at_the_stop(
        smollm2_info: m.TokenizerInfo, smollm2: GatewayTokenizer) -> None:
    ids = smollm2.encode(" red green blue yellow")
    steps = [[frame(0, t, k, "length" if k == len(ids) - 1 else None)]
             for k, t in enumerate(ids)]
    events, gen = generate(smollm2_info, smollm2, steps, stop=[" blue"])
    assert "".join(e.text for e in events) == " red green"
    assert events[-1].finish_reason == "stop"
    assert gen.completion_tokens == len(smollm2.encode(" red green blue"))
