"""Running a load: `run_load(config) -> RunResult`, the one entry point for the CLI and for tests.

    LoadConfig ──▶ model (config or GET /models) ──▶ Workload specs ──▶ open or closed loop
      ──▶ send_request per spec ──▶ RequestRecords ──▶ summarize ──▶ RunResult

Open loop: the schedule (Poisson, or gamma gaps for burstiness != 1) is computed first; one
coroutine sleeps until each arrival time and *creates a task* for it, never awaiting a response,
so the offered load does not bend to the server's speed; each record's send lag (actual minus
scheduled send) shows whether the generator kept up. With `max_concurrency` a task waits for one
of that many slots before it sends (its wait shows as send lag), as `vllm bench serve` does.
Warm-up requests (closed loop, as many at once as the run would have) go before t=0 and are not
recorded. Closed loop: `concurrency` workers, each sending its next request when the previous one
ends, so the load adapts to the server: it measures capacity at a fixed number of users.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp

from loadgen.client import fetch_model, new_session, send_request
from loadgen.config import LoadConfig
from loadgen.progress import Progress
from loadgen.record import RequestRecord
from loadgen.report import Summary, summarize
from loadgen.schedule import poisson_schedule
from loadgen.workload import RequestSpec, Workload, build_request


@dataclass
class RunResult:
    config: LoadConfig
    model: str
    records: list[RequestRecord]  # in request-index order
    duration_s: float  # first send opportunity (t=0) to the last request's end
    summary: Summary

    @staticmethod
    def config_dict(config: LoadConfig) -> dict[str, Any]:
        cfg = asdict(config)
        cfg["rate"] = None if math.isinf(config.rate) else config.rate  # JSON has no Infinity
        cfg.pop("api_key", None)  # a results file is shared; the key is not
        return _jsonable(cfg)

    def to_dict(self, *, records: bool = True, itl: bool = True) -> dict[str, Any]:
        d: dict[str, Any] = {"config": self.config_dict(self.config), "model": self.model,
                             "summary": self.summary.to_dict()}
        if records:
            d["records"] = [r.to_dict(itl=itl) for r in self.records]
        return d


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    return str(obj)  # paths, length distributions


async def run_load(config: LoadConfig, *,
                   session: aiohttp.ClientSession | None = None) -> RunResult:
    """Run one load as configured and return every request's record and the summary."""
    own = session is None
    session = session if session is not None else new_session(config.timeout_s, config.keepalive)
    try:
        model = config.model or await fetch_model(session, config.base_url, config.headers())
        if config.warmup:
            await _Runner(config, session, model, warmup=True).warm_up()
        runner = _Runner(config, session, model)
        records, duration = await runner.run()
    finally:
        if own:
            await session.close()
    summary = summarize(
        records, duration,
        offered_rate=config.rate if config.mode == "open" else None,
        concurrency=config.concurrency if config.mode == "closed" else None,
        slo_ttft_ms=config.slo_ttft_ms, slo_tpot_ms=config.slo_tpot_ms,
        percentiles=config.percentiles)
    return RunResult(config, model, records, duration, summary)


class _Runner:
    def __init__(self, config: LoadConfig, session: aiohttp.ClientSession, model: str, *,
                 warmup: bool = False) -> None:
        self.config = config
        self.session = session
        self.model = model
        # Warm-up prompts come from their own seed: the measured run's specs stay the same.
        self.workload = Workload(config.workload, f"{config.seed}:warmup" if warmup
                                 else config.seed)
        self.slots = (asyncio.Semaphore(config.max_concurrency)
                      if config.max_concurrency is not None else None)
        self.headers = config.headers()  # aiohttp sets Content-Type for a json= body
        self.records: list[RequestRecord] = []
        self.progress = Progress(None, enabled=False)  # replaced once the total is known
        self.start = 0.0

    async def run(self) -> tuple[list[RequestRecord], float]:
        cfg = self.config
        if cfg.mode == "open":
            # The schedule has its own random stream: the same seed gives the same arrival times
            # whatever the workload settings, and vice versa.
            schedule = poisson_schedule(cfg.rate, num_requests=cfg.num_requests,
                                        duration_s=cfg.duration_s,
                                        rng=random.Random(f"{cfg.seed}:schedule"),
                                        burstiness=cfg.burstiness)
            specs = self.workload.take(len(schedule))  # built before t=0: no work in the loop
            self.progress = Progress(len(schedule), enabled=cfg.progress)
            self.start = time.perf_counter()
            await self._open_loop(schedule, specs)
        else:
            self.progress = Progress(cfg.num_requests, enabled=cfg.progress)
            self.start = time.perf_counter()
            await self._closed_loop()
        duration = time.perf_counter() - self.start
        self.progress.close()
        return sorted(self.records, key=lambda r: r.index), duration

    async def warm_up(self) -> None:
        """`warmup` requests, as many at once as the run will have, nothing recorded."""
        cfg = self.config
        width = cfg.concurrency if cfg.mode == "closed" else (cfg.max_concurrency or cfg.warmup)
        specs = self.workload.take(cfg.warmup)
        self.start = time.perf_counter()

        async def worker(mine: list[RequestSpec]) -> None:
            for spec in mine:
                await self._one(spec, 0.0)

        width = max(1, min(width, len(specs)))
        await asyncio.gather(*(worker(specs[i::width]) for i in range(width)))
        self.records.clear()

    async def _open_loop(self, schedule: list[float], specs: list[RequestSpec]) -> None:
        tasks: list[asyncio.Task[None]] = []
        try:
            for offset, spec in zip(schedule, specs, strict=True):
                delay = self.start + offset - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(self._one(spec, offset)))
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:  # on cancellation (Ctrl-C) leave nothing running behind us
                task.cancel()

    async def _closed_loop(self) -> None:
        cfg = self.config
        counter = itertools.count()
        deadline = self.start + cfg.duration_s if cfg.duration_s is not None else math.inf

        async def worker() -> None:
            while True:
                # No await between taking an index and its spec: indices and specs stay in step.
                i = next(counter)
                if cfg.num_requests is not None and i >= cfg.num_requests:
                    return
                if time.perf_counter() >= deadline:
                    return
                await self._one(self.workload.next_spec(), time.perf_counter() - self.start)

        await asyncio.gather(*(worker() for _ in range(cfg.concurrency)))

    async def _one(self, spec: RequestSpec, scheduled_s: float) -> None:
        cfg = self.config
        record = RequestRecord(spec.index, scheduled_s, shared_prefix=spec.shared_prefix,
                               target_prompt_len=spec.prompt_len + spec.prefix_len,
                               target_output_len=spec.output_len)
        self.records.append(record)
        path, body = build_request(spec, cfg.api, self.model, ignore_eos=cfg.ignore_eos,
                                   extra_body=dict(cfg.extra_body), stream=cfg.stream)
        async with self.slots if self.slots is not None else contextlib.nullcontext():
            self.progress.on_sent()
            try:
                await send_request(self.session, cfg.url_base + path, body, self.headers, record,
                                   self.start)
            finally:
                self.progress.on_done(rejected=record.rejected, failed=record.failed)
