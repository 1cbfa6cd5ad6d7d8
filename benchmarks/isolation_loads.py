"""The hostile loads of bench_isolation.py, one process each (so their own CPU work never runs in
the measuring client's event loop). Run until SIGTERM, then print one JSON line of counts:

    python benchmarks/isolation_loads.py LOAD[,LOAD...] --port P --engine ADDR \
        --model-dir DIR --model NAME

    evil     a peer joins the engine link as model "evil" with a chat template that loops without
             writing, sends heartbeats, and keeps 7 chats for "evil" in flight (each re-sent as it
             ends, with a 400 once the render hits --template-timeout-s)
    grammar  8 chats in flight, each with a distinct ~400 KB response_format json_schema (a shared
             tree 8 levels deep), re-sent at once as each ends (429s included), from source
             address 127.0.0.2: without API keys the gateway names a client by its address
    hello    every --hello-every s a fresh peer says Hello as a new model with a ~12 MB tokenizer
             + chat template (the tiny tokenizer, 3.4 MB, and the model's template followed by
             8.5 MB of filler: `text` a literal in an {% if false %}, `nodes` 200k {% set %}
             tags, a minute of Python to compile); a Welcome's model gets one chat
    noread   --count streams (chat, 1000 tokens, logprobs) from sockets with a 4 KB receive
             buffer that never read; each is replaced after --hold-s
    slow     --count connections, half sending the headers a byte at a time, half the headers at
             once and the body a byte at a time, one byte every --byte-s; each reopened as the
             server ends it
    flood    a peer joins as model "rogue" and sends StepOutputs as fast as the link takes them,
             each within every check (8 rows, its seats, of 16 tokens for request ids that are
             not the gateway's, as rows of cancelled requests are), with heartbeats
    empty    a peer joins as model "rogue" and sends StepOutputs with no rows as fast as the link
             takes them; dropped for it, it says Hello again and goes on
    arith    a peer joins as model "arith" whose chat template does big arithmetic when a
             message asks (10 ** 3.3 million, a 1.2 GB string) and holds a constant
             10 ** 12000000; 3 clients keep chats for it in flight

HTTP is raw asyncio (http_request): one connection per request, Connection: close.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import signal
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.overload_client import never_reading  # noqa: E402
from protocol import codec  # noqa: E402
from protocol import messages as m  # noqa: E402
from tests.e2e.link_peers import FakeWorker, tiny_hello  # noqa: E402
from tests.e2e.test_gateway_isolation import (  # noqa: E402
    ARITHMETIC,
    SILENT_LOOPS,
    deep_schema,
)

HOST = "127.0.0.1"


def request_bytes(method: str, path: str, body: bytes = b"") -> bytes:
    head = (f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


async def http_request(port: int, method: str, path: str, body: bytes = b"",
                       timeout: float = 60, local: str | None = None) -> tuple[int, bytes]:
    """(status, whole answer) of one request; status 0 for a connection that failed."""
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(
                HOST, port, local_addr=(local, 0) if local else None)
            try:
                writer.write(request_bytes(method, path, body))
                answer = await reader.read(-1)
            finally:
                writer.close()
    except (OSError, TimeoutError):
        return 0, b""
    try:
        return int(answer.split(b" ", 2)[1]), answer
    except (IndexError, ValueError):
        return 0, answer


def chat_body(model: str, content: str = "hi", **extra: object) -> bytes:
    return json.dumps({"model": model, "max_tokens": 2, **extra,
                       "messages": [{"role": "user", "content": content}]}).encode()


async def or_stop(aw, stop: asyncio.Event):
    """`aw`'s result, or None when `stop` is set first (`aw` is then cancelled)."""
    task, stopping = asyncio.ensure_future(aw), asyncio.ensure_future(stop.wait())
    await asyncio.wait([task, stopping], return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return None


async def keep_sending(counts: Counter, stop: asyncio.Event, port: int, make_body,
                       local: str | None = None) -> None:
    """One request in flight at a time, re-sent as soon as each ends."""
    i = 0
    while not stop.is_set():
        answer = await or_stop(http_request(port, "POST", "/v1/chat/completions",
                                             make_body(i), local=local), stop)
        if answer is None:
            counts["cut_at_stop"] += 1
            return
        status = answer[0]
        counts[f"http_{status}"] += 1
        i += 1
        if status == 0:  # refused (the gateway is gone): no busy loop on shared cores
            await asyncio.sleep(0.1)


async def templated_peer(a: argparse.Namespace, counts: Counter, stop: asyncio.Event,
                         model_id: str, template: str, contents: list[str]) -> None:
    """A peer of `model_id` whose chat template is `template`, with heartbeats, and one chat
    for it in flight per entry of `contents` (each re-sent as it ends)."""
    peer = FakeWorker(a.engine)
    info = tiny_hello(a.model_dir).tokenizer
    hello = tiny_hello(a.model_dir, model_id=model_id,
                       tokenizer=dataclasses.replace(info, chat_template=template))
    try:
        welcome = await asyncio.to_thread(peer.hello, hello)
        counts["welcome" if welcome is not None and welcome.accepted else "no_welcome"] += 1

        async def beat() -> None:
            while not stop.is_set():
                peer.send(m.Heartbeat(hello.worker_id, m.Stats()))
                await asyncio.sleep(0.2)

        await asyncio.gather(beat(), *(keep_sending(
            counts, stop, a.port, lambda _i, c=c: chat_body(model_id, c)) for c in contents))
    finally:
        peer.close()


async def evil(a: argparse.Namespace, counts: Counter, stop: asyncio.Event) -> None:
    await templated_peer(a, counts, stop, "evil", SILENT_LOOPS, ["hi"] * 7)


async def grammar(a: argparse.Namespace, counts: Counter, stop: asyncio.Event) -> None:
    schema = {"type": "json_schema", "json_schema": {"name": "deep",
                                                     "schema": deep_schema(leaf="VARIANT-0000000")}}
    shape = chat_body(a.model, "json", response_format=schema)
    counts["body_bytes"] = len(shape)
    serial = iter(range(1, 1 << 30))  # every request a schema of its own: no grammar cache hit

    def body(_i: int) -> bytes:
        return shape.replace(b"VARIANT-0000000", b"VARIANT-%07d" % next(serial))

    await asyncio.gather(*(keep_sending(counts, stop, a.port, body, local="127.0.0.2")
                           for _ in range(8)))


def big_hello(model_dir: Path, filler: str) -> m.Hello:
    info = tiny_hello(model_dir).tokenizer
    if filler == "nodes":
        pad = "{% set pad = 'xxxxxxxxxxxxxxxxxxxxxxxxxx' %}\n" * 200_000
    else:
        pad = "{% if false %}" + "lorem ipsum " * 700_000 + "{% endif %}"
    return tiny_hello(model_dir, tokenizer=dataclasses.replace(
        info, chat_template=(info.chat_template or "") + pad))


async def hello(a: argparse.Namespace, counts: Counter, stop: asyncio.Event) -> None:
    base = big_hello(a.model_dir, a.hello_filler)
    counts["hello_bytes"] = sum(len(f) for f in codec.encode(base))
    chats: list[asyncio.Task] = []
    n = 0
    while not stop.is_set():
        n += 1
        msg = dataclasses.replace(base, worker_id=f"big{n}-{time.time_ns()}", model_id=f"big-{n}")
        peer = FakeWorker(a.engine)
        try:
            peer.send(msg)
            end = time.monotonic() + a.hello_every
            answer = None
            while answer is None and not stop.is_set() and time.monotonic() < end:
                got = await asyncio.to_thread(peer.recv, 0.2)
                answer = got if isinstance(got, m.Welcome) else None
            if answer is None:
                counts["no_answer"] += 1
            elif answer.accepted:
                counts["welcome"] += 1
                chats.append(asyncio.create_task(http_request(
                    a.port, "POST", "/v1/chat/completions", chat_body(msg.model_id, timeout=2))))
            else:
                counts["refused"] += 1
                counts["refusal: " + answer.reason[:60]] += 1
            while not stop.is_set() and time.monotonic() < end:
                await asyncio.sleep(0.1)
        finally:
            peer.close()
    for status, _ in await asyncio.gather(*chats):
        counts[f"big_chat_http_{status}"] += 1


async def noread(a: argparse.Namespace, counts: Counter, stop: asyncio.Event) -> None:
    body = {"model": a.model, "max_tokens": 1000, "ignore_eos": True, "logprobs": True,
            "top_logprobs": 5, "messages": [{"role": "user", "content": "hi"}]}

    async def one(k: int) -> None:
        await or_stop(asyncio.sleep(k * a.hold_s / a.count), stop)  # staggered replacements
        while not stop.is_set():
            held = asyncio.Event()
            timer = asyncio.get_running_loop().call_later(a.hold_s, held.set)
            waiter = asyncio.create_task(stop.wait())
            waiter.add_done_callback(lambda _t, h=held: h.set())
            out = await never_reading(HOST, a.port, "/v1/chat/completions", body, held)
            timer.cancel()
            waiter.cancel()
            counts[out.result] += 1
            if out.result.startswith("client_error"):
                await asyncio.sleep(0.1)  # refused: no busy loop

    await asyncio.gather(*(one(k) for k in range(a.count)))


async def slow(a: argparse.Namespace, counts: Counter, stop: asyncio.Event) -> None:
    data = request_bytes("POST", "/v1/chat/completions", chat_body(a.model))
    head_end = data.index(b"\r\n\r\n") + 4

    async def one(k: int) -> None:
        by_byte = "headers" if k % 2 == 0 else "body"
        stopping = asyncio.create_task(stop.wait())
        try:
            await one_connection_at_a_time(by_byte, stopping)
        finally:
            stopping.cancel()

    async def one_connection_at_a_time(by_byte: str, stopping: asyncio.Task) -> None:
        while not stop.is_set():
            try:
                reader, writer = await asyncio.open_connection(HOST, port=a.port)
            except OSError:
                counts[f"{by_byte}_connect_error"] += 1
                await asyncio.sleep(a.byte_s)
                continue
            ended = asyncio.create_task(reader.read(64))
            start = 0
            if by_byte == "body":
                writer.write(data[:head_end])
                start = head_end
            outcome = "cut_by_us"
            try:
                for i in range(start, len(data)):
                    writer.write(data[i:i + 1])
                    await writer.drain()
                    done, _ = await asyncio.wait([ended, stopping], timeout=a.byte_s,
                                                 return_when="FIRST_COMPLETED")
                    if ended in done or stop.is_set():
                        break
                if ended.done():
                    got = ended.result()
                    outcome = got[9:12].decode(errors="replace") if got else "closed"
                elif not stop.is_set():
                    outcome = "sent_whole"
            except OSError:
                outcome = "reset"
            finally:
                ended.cancel()
                writer.close()
            counts[f"{by_byte}_{outcome}"] += 1

    await asyncio.gather(*(one(k) for k in range(a.count)))


def rogue_peer(a: argparse.Namespace, frame: object, counts: Counter,
               stop: asyncio.Event) -> None:
    """A peer of model "rogue" sending `frame` as fast as the socket takes it, heartbeats
    between bursts, a new Hello whenever the gateway forgets it (a Reset). Runs in a thread."""
    import zmq

    peer = FakeWorker(a.engine)
    hello = tiny_hello(a.model_dir, model_id="rogue")
    try:
        while not stop.is_set():
            if peer.hello(hello, timeout_s=2.0) is None:
                counts["no_welcome"] += 1
                continue
            counts["welcome"] += 1
            beat = 0.0
            while not stop.is_set():
                if time.monotonic() - beat > 0.2:
                    peer.send(m.Heartbeat(hello.worker_id, m.Stats()))
                    beat = time.monotonic()
                if peer.sock.poll(0, zmq.POLLIN) and isinstance(peer.recv(0), m.Reset):
                    counts["reset"] += 1
                    break  # forgotten (dropped): say Hello again
                for _ in range(64):
                    counts["frames"] += peer.send(frame)
    finally:
        peer.close()


async def flood(a: argparse.Namespace, counts: Counter, stop: asyncio.Event) -> None:
    rows = [m.TokenOutput(f"not-yours-{i}", 0, [7] * 16) for i in range(8)]
    await asyncio.to_thread(rogue_peer, a, m.StepOutputs(rows), counts, stop)


async def empty(a: argparse.Namespace, counts: Counter, stop: asyncio.Event) -> None:
    await asyncio.to_thread(rogue_peer, a, m.StepOutputs([]), counts, stop)


async def arith(a: argparse.Namespace, counts: Counter, stop: asyncio.Event) -> None:
    template = ARITHMETIC.replace("833334", "1100000")  # 10 ** 3.3 M for "pow"
    await templated_peer(a, counts, stop, "arith", template, ["pow", "mul", "other"])


LOADS = {"evil": evil, "grammar": grammar, "hello": hello, "noread": noread, "slow": slow,
         "flood": flood, "empty": empty, "arith": arith}


async def main_async(a: argparse.Namespace) -> Counter:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    counts: Counter = Counter()
    tasks = [asyncio.create_task(LOADS[name](a, counts, stop)) for name in a.loads.split(",")]
    await stop.wait()
    done, pending = await asyncio.wait(tasks, timeout=5)  # each notices `stop` within ~3 s
    for t in pending:
        t.cancel()
        counts["cancelled_at_stop"] += 1
    await asyncio.gather(*pending, return_exceptions=True)
    for t in done:
        if t.exception() is not None:
            counts[f"load_failed: {type(t.exception()).__name__}: {t.exception()}"[:120]] += 1
    return counts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("loads", help="comma list of: " + ", ".join(LOADS))
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--engine", required=True, help="the gateway's engine link address")
    p.add_argument("--model-dir", type=Path, required=True, help="the tokenizer the peers send")
    p.add_argument("--model", required=True, help="the real model's id")
    p.add_argument("--count", type=int, default=16, help="noread / slow connections")
    p.add_argument("--hold-s", type=float, default=8.0)
    p.add_argument("--byte-s", type=float, default=0.2)
    p.add_argument("--hello-every", type=float, default=3.0)
    p.add_argument("--hello-filler", choices=("text", "nodes"), default="text")
    a = p.parse_args()
    counts = asyncio.run(main_async(a))
    print(json.dumps({"loads": a.loads, "counts": dict(sorted(counts.items()))}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
