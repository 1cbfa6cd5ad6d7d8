"""Isolation benchmark (issue 23; not a timed test): does a hostile load slow anyone else?

One gateway (--template-timeout-s 0.5 --drain-timeout-s 2) and one real worker (the tiny random
model of tests/conftest.py, or --model smollm2 / a folder). An unrelated "calm" client streams
chats to the real model (max_tokens 8, ignore_eos; --concurrency at a time), timing TTFT (sent
to the first SSE chunk with content), and GETs /health/live every 50 ms; both raw asyncio (a
connection per request, chunked answers decoded by hand: no client library's cost in the
figures). "loop lag" is the gateway's own kestrel_event_loop_lag_seconds over the phase.

Phases, --seconds each after --warmup s of load: idle, then each load of isolation_loads.py
alone (evil template worker, grammar flood, 12 MB Hellos, never-reading streams, slowloris, a
rogue worker's frame flood and empty frames, template arithmetic), in a process of its own
stopped at the phase's end. Last, SIGTERM to the gateway while never-reading
and slow clients and the calm streams run: seconds to its exit. Goals: p99 at most 2x idle's,
exit within drain timeout + 5 s. Run from the repository root:

    python benchmarks/bench_isolation.py [--seconds 15] [--model tiny|smollm2|DIR]
        [--phases idle,evil,grammar,hello,noread,slow,flood,empty,arith,sigterm] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_overload import wait_idle  # noqa: E402
from benchmarks.isolation_loads import HOST, http_request, request_bytes  # noqa: E402
from benchmarks.overload_client import ms, pct, rss_mib  # noqa: E402
from tests.procs import GatewayProc, Proc, WorkerProc  # noqa: E402

PHASES = ("idle", "evil", "grammar", "hello", "noread", "slow", "flood", "empty", "arith",
          "sigterm")


def cpu_model() -> str:
    info = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in
             (info.read_text().splitlines() if info.exists() else []) if line.startswith("model n")]
    return names[0] if names else platform.processor() or "unknown"


def the_model(choice: str) -> tuple[Path, str, list[str]]:
    """(checkpoint folder, the id requests use, worker flags), by the tests' own fixtures."""
    from tests import conftest  # the fixtures' functions, called as functions

    cache = conftest.cache_dir.__wrapped__()
    smollm2 = conftest.smollm2_dir.__wrapped__(cache)
    if choice == "smollm2":
        return smollm2, "SmolLM2-135M-Instruct", ["--model-id", "SmolLM2-135M-Instruct"]
    path = conftest.tiny_model_dir.__wrapped__(cache, smollm2) if choice == "tiny" \
        else Path(choice)
    return path, path.name, []


async def chat_ttft(port: int, body: bytes, timeout: float) -> float | str:
    """TTFT in seconds of one streamed chat, or why it failed."""
    t0 = time.monotonic()
    ttft: float | None = None
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(HOST, port)
            try:
                writer.write(request_bytes("POST", "/v1/chat/completions", body))
                head = await reader.readuntil(b"\r\n\r\n")
                if not head.startswith(b"HTTP/1.1 200"):
                    return "http_" + head[9:12].decode(errors="replace")
                chunked, buf = b"chunked" in head.lower(), b""
                while True:
                    if chunked:
                        size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
                        piece = (await reader.readexactly(size + 2))[:-2] if size else b""
                    else:
                        piece = await reader.read(65536)
                    if not piece:
                        return "closed_before_done"
                    buf += piece
                    while b"\n\n" in buf:
                        event, buf = buf.split(b"\n\n", 1)
                        if not event.startswith(b"data: "):
                            continue  # a keep-alive comment
                        if event == b"data: [DONE]":
                            return ttft if ttft is not None else "no_content"
                        data = json.loads(event[6:])
                        if "error" in data:
                            return "stream_error"
                        if ttft is None and any((c.get("delta") or {}).get("content")
                                                for c in data.get("choices", [])):
                            ttft = time.monotonic() - t0
            finally:
                writer.close()
    except TimeoutError:
        return "timeout"
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
        return type(exc).__name__


async def measure(port: int, body: bytes, seconds: float, a: argparse.Namespace,
                  stop: asyncio.Event | None = None) -> dict[str, Any]:
    """The calm client for `seconds` (or until `stop`): TTFTs and /health/live latencies."""
    res: dict[str, Any] = {"ttft_s": [], "live_s": [], "chat_errors": Counter(),
                           "live_errors": Counter()}
    end = time.monotonic() + seconds
    stop = stop or asyncio.Event()

    def going() -> bool:
        return time.monotonic() < end and not stop.is_set()

    async def chats() -> None:
        while going():
            out = await chat_ttft(port, body, a.chat_timeout)
            if isinstance(out, float):
                res["ttft_s"].append(out)
            else:
                res["chat_errors"][out] += 1
                await asyncio.sleep(0.05)  # a 503 or a refusal: no busy loop

    async def live() -> None:
        due = time.monotonic()
        while going():
            t = time.monotonic()
            status, _ = await http_request(port, "GET", "/health/live", timeout=5)
            if status == 200:
                res["live_s"].append(time.monotonic() - t)
            else:
                res["live_errors"][f"http_{status}"] += 1
            due = max(due + a.live_every, time.monotonic())
            await asyncio.sleep(due - time.monotonic())

    await asyncio.gather(live(), *(chats() for _ in range(a.concurrency)))
    return res


def start_load(loads: str, gw: GatewayProc, model_dir: Path, model: str,
               a: argparse.Namespace) -> Proc:
    return Proc([sys.executable, str(ROOT / "benchmarks" / "isolation_loads.py"), loads,
                 "--port", str(gw.port), "--engine", gw.engine_address, "--model-dir",
                 str(model_dir), "--model", model, "--count", str(a.count),
                 "--hello-filler", a.hello_filler]).start()


def stop_load(load: Proc) -> dict[str, Any]:
    """SIGTERM, then its counts (its last JSON line); killed if it takes over 15 s."""
    rc = load.stop(timeout=15)
    for line in reversed(load.output().splitlines()):
        if line.startswith("{"):
            return {**json.loads(line)["counts"], **({"exit": rc} if rc else {})}
    return {"exit": rc, "output": load.output()[-500:]}


def lag_buckets(base: str) -> dict[float, float]:
    """The gateway's event-loop lag histogram (kestrel_event_loop_lag_seconds): le -> count."""
    text = httpx.get(base + "/metrics", timeout=5).text
    return {float(line.split('le="')[1].split('"')[0]): float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("kestrel_event_loop_lag_seconds_b")}


def lag_p99(before: dict[float, float], after: dict[float, float]) -> float | None:
    """The smallest bucket bound that holds 99 % of the lag samples taken between the two."""
    n = after.get(float("inf"), 0) - before.get(float("inf"), 0)
    return next((le for le in sorted(after) if after[le] - before.get(le, 0) >= 0.99 * n),
                None) if n > 0 else None


async def sigterm_phase(gw: GatewayProc, body: bytes, a: argparse.Namespace) -> dict[str, Any]:
    """The calm streams (and the loads already started) run; SIGTERM; time to the exit."""
    assert gw.popen is not None
    stop = asyncio.Event()
    calm = asyncio.create_task(measure(gw.port, body, 3600, a, stop))
    await asyncio.sleep(1.0)
    t0 = time.monotonic()
    gw.signal(signal.SIGTERM)
    limit = a.drain + 5
    while gw.popen.poll() is None and time.monotonic() - t0 < limit + 10:
        await asyncio.sleep(0.01)
    exit_s = time.monotonic() - t0 if gw.popen.poll() is not None else None
    stop.set()
    res = await calm
    if exit_s is None:
        gw.kill()
    return {"exit_s": exit_s, "limit_s": limit, "returncode": gw.popen.returncode,
            "calm_chats_in_drain": len(res["ttft_s"]),
            "calm_chat_errors": dict(res["chat_errors"])}


def ratio(x: float | None, base: float | None) -> str:
    return "-" if x is None or not base else f"{x / base:.2f}"


def print_row(name: str, r: dict[str, Any], idle: dict[str, Any] | None) -> None:
    t50, t99 = pct(r["ttft_s"], 50), pct(r["ttft_s"], 99)
    l50, l99 = pct(r["live_s"], 50), pct(r["live_s"], 99)
    bt, bl = (pct(idle["ttft_s"], 99), pct(idle["live_s"], 99)) if idle else (None, None)
    errors = sum(r["chat_errors"].values()) + sum(r["live_errors"].values())
    print(f"| {name} | {ms(t50)} | {ms(t99)} | {ratio(t99, bt)} | {ms(l50)} | {ms(l99)} | "
          f"{ratio(l99, bl)} | {ms(r['loop_lag_p99_s'])} | {len(r['ttft_s'])} | "
          f"{len(r['live_s'])} | {errors} | {r['gateway_rss_mib']:.0f} |", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="tiny", help="tiny (default), smollm2 or a folder")
    p.add_argument("--seconds", type=float, default=15.0, help="measured seconds a phase")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds a load runs unmeasured")
    p.add_argument("--phases", default=",".join(PHASES))
    p.add_argument("--concurrency", type=int, default=1, help="calm chats at a time")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--live-every", type=float, default=0.05)
    p.add_argument("--chat-timeout", type=float, default=35.0)
    p.add_argument("--count", type=int, default=16, help="never-reading / slow connections")
    p.add_argument("--hello-filler", choices=("text", "nodes"), default="text")
    p.add_argument("--sigterm-loads", default="noread,slow")
    p.add_argument("--drain", type=float, default=2.0, help="the gateway's --drain-timeout-s")
    p.add_argument("--threads", type=int, default=1, help="the worker's torch threads")
    p.add_argument("--gateway-args", default="", help="more gateway flags, one string")
    p.add_argument("--json", type=Path, help="write the raw figures here")
    a = p.parse_args()
    if unknown := set(phases := [x for x in a.phases.split(",") if x]) - set(PHASES):
        p.error(f"unknown phases {sorted(unknown)}")
    print(f"CPU: {cpu_model()} ({len(os.sched_getaffinity(0))} usable cores)")
    model_dir, model, model_flags = the_model(a.model)
    body = json.dumps({"model": model, "max_tokens": a.max_tokens, "ignore_eos": True,
                       "temperature": 0, "stream": True, "messages": [
                           {"role": "user", "content": "What is the capital of France?"}]}).encode()
    out: dict[str, Any] = {"cpu": cpu_model(), "args": {k: str(v) for k, v in vars(a).items()},
                           "phases": {}}
    gw = GatewayProc("--template-timeout-s", "0.5", "--drain-timeout-s", str(a.drain),
                     "--log-level", "WARNING", *shlex.split(a.gateway_args))
    wk = WorkerProc(model_dir, gw.engine_address, "--threads", str(a.threads), *model_flags,
                    env={"KESTREL_LOG_LEVEL": "WARNING"})
    loads: list[Proc] = []
    try:
        gw.start()
        wk.start()
        gw.wait_ready(timeout=300)
        assert gw.popen is not None
        asyncio.run(measure(gw.port, body, 3.0, a))  # the model's first steps
        print(f"\nmodel {model}; {a.seconds:g} s a phase after {a.warmup:g} s of load; calm "
              f"client: {a.concurrency} stream(s), max_tokens {a.max_tokens}\n")
        print("| phase | TTFT p50 ms | TTFT p99 ms | x idle | live p50 ms | live p99 ms | x idle "
              "| loop lag p99 <= ms | chats | probes | errors | gw RSS MiB |")
        print("|---|" + "---:|" * 11, flush=True)
        for name in (x for x in phases if x != "sigterm"):
            if name != "idle":
                loads.append(start_load(name, gw, model_dir, model, a))
                time.sleep(a.warmup)
            lag0 = lag_buckets(gw.base_url)
            res = asyncio.run(measure(gw.port, body, a.seconds, a))
            res["loop_lag_p99_s"] = lag_p99(lag0, lag_buckets(gw.base_url))
            res["load"] = stop_load(loads.pop()) if name != "idle" else {}
            res["gateway_rss_mib"] = rss_mib(gw.popen.pid) or 0.0
            out["phases"][name] = res
            print_row(name, res, out["phases"].get("idle"))
            if wk.popen is None or wk.popen.poll() is not None or gw.popen.poll() is not None:
                print(f"exited during {name} (worker {wk.popen and wk.popen.poll()}, gateway "
                      f"{gw.popen.poll()}; logs {wk.log_path} {gw.log_path}): stopping here")
                return 1  # a benchmark of a server without its worker would measure 503s
            wait_idle(gw.base_url)
        print()
        for name, res in out["phases"].items():
            errs = {**res["chat_errors"], **{"live_" + k: v for k, v in res["live_errors"].items()}}
            if res["load"] or errs:
                print(f"- {name}: calm errors {errs or 'none'}; load {res['load']}")
        if "sigterm" in phases:
            loads.append(start_load(a.sigterm_loads, gw, model_dir, model, a))
            time.sleep(a.warmup)
            res = asyncio.run(sigterm_phase(gw, body, a))
            res["load"] = stop_load(loads.pop())
            out["sigterm"] = res
            took = "did not exit (killed)" if res["exit_s"] is None else f"{res['exit_s']:.2f} s"
            print(f"\nSIGTERM with {a.sigterm_loads} and the calm streams running: exited in "
                  f"{took} (goal <= drain {a.drain:g} s + 5 s = {res['limit_s']:g} s), "
                  f"exit code {res['returncode']}; {res['calm_chats_in_drain']} calm chats done "
                  f"after it, calm errors {res['calm_chat_errors']}; load {res['load']}")
    finally:
        for load in loads:
            load.stop(timeout=15)
        wk.stop()
        gw.stop()
        print(f"tracebacks in the gateway log ({gw.log_path}): {gw.output().count('Traceback')}")
        if a.json:
            a.json.write_text(json.dumps(out, indent=1))
            print(f"raw figures: {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
