"""A rate sweep: open-loop runs at rising offered loads, and where the server saturates.

    LoadConfig + rates ──run_load at each rate──▶ SweepPoints ──find_saturation──▶ SweepResult
      ──▶ JSON (every point) and plot.plot_sweep (the hockey stick)

Every point reuses the same seed, so the arrival schedules are the same exponential draws scaled by
1/rate and the prompts are identical: points differ in load only (common random numbers). A point
is saturated when the server no longer keeps up with the offered load (completed requests/s below
90% of offered) or queueing shows in latency (P99 TTFT over 5x its value at the lowest rate); the
first saturated rate is the knee of the hockey stick. "Offered" is the rate the schedule actually
realised (requests / last send time), not the nominal one: a Poisson run of N requests spans
N/rate ± sqrt(N)/rate seconds, which alone would move a 100-request point by ~10%. Completed
requests/s also pays for the tail (the last requests' latency after the last send), so give each
point enough requests that rate x E2E latency is small against their number.

The automatic sweep (`run_auto_sweep`, `--rates auto`) finds its own range first, like guidellm's:
the synchronous rate (one request at a time, closed loop: the rate of a single user) and the
saturating rate (every request at once: the most the server completes per second), then runs
open-loop points evenly spaced from the one to the other.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from loadgen.config import LoadConfig
from loadgen.report import Summary
from loadgen.runner import RunResult, run_load

THROUGHPUT_FRACTION = 0.9
TTFT_GROWTH = 5.0


@dataclass(frozen=True)
class SweepPoint:
    rate: float
    summary: Summary

    def to_dict(self) -> dict[str, Any]:
        return {"rate": self.rate, "summary": self.summary.to_dict()}


@dataclass(frozen=True)
class SweepResult:
    points: list[SweepPoint]
    saturation_index: int | None
    saturation_reason: str | None
    synchronous: Summary | None = None  # the automatic sweep's two probing runs
    throughput: Summary | None = None

    @property
    def synchronous_rate(self) -> float | None:
        return None if self.synchronous is None else self.synchronous.request_throughput

    @property
    def max_rate(self) -> float | None:
        return None if self.throughput is None else self.throughput.request_throughput

    @property
    def saturation_rate(self) -> float | None:
        return None if self.saturation_index is None else self.points[self.saturation_index].rate

    def to_dict(self) -> dict[str, Any]:
        return {"points": [p.to_dict() for p in self.points],
                "saturation": {"index": self.saturation_index, "rate": self.saturation_rate,
                               "reason": self.saturation_reason,
                               "rule": f"achieved < {THROUGHPUT_FRACTION:g} x offered req/s, or "
                                       f"P99 TTFT > {TTFT_GROWTH:g} x the lowest rate's"},
                **({"auto": {"synchronous_rate": self.synchronous_rate,
                             "max_rate": self.max_rate,
                             "synchronous": self.synchronous.to_dict(),
                             "throughput": self.throughput.to_dict()}}
                   if self.synchronous is not None and self.throughput is not None else {})}


def parse_rates(text: str) -> list[float]:
    """`1,2,4,8` -> [1.0, 2.0, 4.0, 8.0]; `inf` allowed. Sorted ascending, duplicates removed."""
    try:
        rates = sorted({float(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"bad rates {text!r}: expected numbers like 1,2,4,8") from None
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"bad rates {text!r}: need at least one rate, all > 0")
    return rates


def find_saturation(points: Sequence[SweepPoint]) -> tuple[int | None, str | None]:
    """The first point that is saturated, and why; (None, None) when none is."""
    if not points:
        return None, None
    base = points[0].summary.ttft.p99
    for i, p in enumerate(points):
        s = p.summary
        offered = s.sent_rate if math.isfinite(s.sent_rate) else p.rate
        if math.isfinite(p.rate) and s.request_throughput < THROUGHPUT_FRACTION * offered:
            return i, (f"achieved {s.request_throughput:.2f} req/s < "
                       f"{THROUGHPUT_FRACTION:g} x offered {offered:.2f}")
        p99 = s.ttft.p99
        if i > 0 and math.isfinite(base) and base > 0 and p99 > TTFT_GROWTH * base:
            return i, f"P99 TTFT {p99:.0f} ms > {TTFT_GROWTH:g} x {base:.0f} ms at the lowest rate"
    return None, None


async def run_sweep(config: LoadConfig, rates: Sequence[float], *, cooldown_s: float = 0.0,
                    on_point: Callable[[SweepPoint, RunResult], None] | None = None
                    ) -> SweepResult:
    """Run `config` open-loop at each rate (ascending) and find the saturation point."""
    points: list[SweepPoint] = []
    for i, rate in enumerate(sorted(rates)):
        if i and cooldown_s > 0:
            await asyncio.sleep(cooldown_s)  # let the previous point's queue drain
        result = await run_load(replace(config, mode="open", rate=rate))
        point = SweepPoint(rate, result.summary)
        points.append(point)
        if on_point is not None:
            on_point(point, result)
    index, reason = find_saturation(points)
    return SweepResult(points, index, reason)


def auto_rates(synchronous_rate: float, max_rate: float, num_points: int) -> list[float]:
    """`num_points` rates evenly spaced from the synchronous to the saturating rate (both
    included); one point when the two are equal (or the server got slower under load)."""
    if num_points < 1:
        raise ValueError("num_points must be >= 1")
    if max_rate <= synchronous_rate or num_points == 1:
        return [synchronous_rate]
    step = (max_rate - synchronous_rate) / (num_points - 1)
    return [synchronous_rate + i * step for i in range(num_points)]


async def run_auto_sweep(config: LoadConfig, num_points: int, *, cooldown_s: float = 0.0,
                         on_point: Callable[[SweepPoint, RunResult], None] | None = None,
                         on_probe: Callable[[str, RunResult], None] | None = None
                         ) -> SweepResult:
    """Find the synchronous and the saturating rate, then sweep between them."""
    sync = await run_load(replace(config, mode="closed", concurrency=1))
    if on_probe is not None:
        on_probe("synchronous", sync)
    burst = await run_load(replace(config, mode="open", rate=math.inf))
    if on_probe is not None:
        on_probe("throughput", burst)
    s_rate, m_rate = sync.summary.request_throughput, burst.summary.request_throughput
    if not (s_rate > 0 and math.isfinite(s_rate) and math.isfinite(m_rate)):
        raise RuntimeError(f"no requests completed while probing (synchronous {s_rate:.3g}, "
                           f"saturating {m_rate:.3g} req/s): see the error samples")
    if cooldown_s > 0:
        await asyncio.sleep(cooldown_s)
    swept = await run_sweep(config, auto_rates(s_rate, m_rate, num_points),
                            cooldown_s=cooldown_s, on_point=on_point)
    return replace(swept, synchronous=sync.summary, throughput=burst.summary)


SWEEP_HEAD = ["offered req/s", "achieved req/s", "tok/s", "TTFT P50", "TTFT P99", "E2E P50",
              "E2E P99", "429 %", "err %", "goodput req/s"]


def sweep_rows(result: SweepResult) -> list[list[str]]:
    """One row per point, latencies in ms, for the terminal and Markdown tables."""
    def f(x: float, digits: int = 1) -> str:
        return f"{x:,.{digits}f}" if math.isfinite(x) else "-"

    rows = []
    for i, p in enumerate(result.points):
        s = p.summary
        mark = " *" if i == result.saturation_index else ""
        rows.append([f"{p.rate:g}{mark}", f(s.request_throughput, 2), f(s.output_throughput),
                     f(s.ttft.p50), f(s.ttft.p99), f(s.e2e.p50), f(s.e2e.p99),
                     f(s.rejection_rate * 100), f(s.error_rate * 100), f(s.goodput, 2)])
    return rows
