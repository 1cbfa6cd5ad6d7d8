"""From records to numbers and text: percentiles, goodput, a terminal table, JSON, Markdown.

    list[RequestRecord] + wall time ──summarize──▶ Summary ──▶ format_table / markdown_section /
                                                                Summary.to_dict (JSON)

Latency distributions use successful requests only (a rejected request has no TTFT; an errored
one's latency measures the failure). ITL pools every gap between token chunks of every successful
request; TPOT is per token (a chunk may carry several: RequestRecord.tpot_s). Token totals
sum `usage` over every record that has one, whatever its outcome, so they match what the server
counted. Goodput counts successful requests that met every SLO set (a TPOT target cannot be
missed by a one-token answer) per second of wall time.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loadgen.record import RequestRecord

PERCENTILES = (50, 90, 95, 99)


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile with linear interpolation between ranks (numpy's default): for n sorted
    values the rank is p/100 * (n - 1). NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    rank = p / 100 * (len(xs) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


@dataclass(frozen=True)
class Distribution:
    """A latency distribution in milliseconds."""

    count: int
    mean: float
    p50: float
    p90: float
    p95: float
    p99: float
    # The percentiles asked for (--percentiles), keyed "p50", "p99.9"...; p50..p99 above always.
    chosen: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of_seconds(cls, values: Iterable[float],
                   percentiles: Sequence[float] = PERCENTILES) -> Distribution:
        ms = [v * 1000.0 for v in values]
        mean = sum(ms) / len(ms) if ms else math.nan
        return cls(len(ms), mean, *(percentile(ms, p) for p in PERCENTILES),
                   chosen={pct_name(p): percentile(ms, p) for p in percentiles})


def pct_name(p: float) -> str:
    return f"p{p:g}"


@dataclass(frozen=True)
class Summary:
    num_requests: int
    completed: int
    rejected: int
    errors: int
    duration_s: float
    offered_rate: float | None  # open loop: the configured requests/s
    concurrency: int | None  # closed loop
    sent_rate: float  # requests sent per second, over the sending window (0 to the last send)
    request_throughput: float  # completed requests per second
    output_throughput: float  # completion tokens per second (successful requests)
    goodput: float  # completed requests per second that met the SLOs
    rejection_rate: float  # 429s over all requests
    error_rate: float
    prompt_tokens: int
    completion_tokens: int
    max_send_lag_ms: float
    slo_ttft_ms: float | None
    slo_tpot_ms: float | None
    ttft: Distribution
    itl: Distribution
    tpot: Distribution
    e2e: Distribution
    error_samples: list[str] = field(default_factory=list)
    # Prompt + completion tokens of successful requests per second (vLLM's "total token
    # throughput"): what a server's prefill and decode together got through.
    total_token_throughput: float = math.nan

    def to_dict(self) -> dict[str, Any]:
        return _finite(asdict(self))


def _finite(obj: Any) -> Any:
    # JSON has no NaN/Infinity; a metric with no samples is written as null.
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def meets_slo(r: RequestRecord, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    if not r.ok:
        return False
    if slo_ttft_ms is not None and (r.ttft_s is None or r.ttft_s * 1000 > slo_ttft_ms):
        return False
    tpot = r.tpot_s
    return slo_tpot_ms is None or tpot is None or tpot * 1000 <= slo_tpot_ms


def summarize(records: Sequence[RequestRecord], duration_s: float, *,
              offered_rate: float | None = None, concurrency: int | None = None,
              slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None,
              percentiles: Sequence[float] = PERCENTILES) -> Summary:
    ok = [r for r in records if r.ok]
    n = len(records)
    rejected = sum(r.rejected for r in records)
    errors = sum(r.failed for r in records)
    wall = duration_s if duration_s > 0 else math.nan
    good = sum(meets_slo(r, slo_ttft_ms, slo_tpot_ms) for r in records)
    samples = list(dict.fromkeys(r.error for r in records if r.failed and r.error))[:5]
    return Summary(
        num_requests=n, completed=len(ok), rejected=rejected, errors=errors,
        duration_s=duration_s, offered_rate=offered_rate, concurrency=concurrency,
        sent_rate=n / last_sent if (last_sent := max((r.sent_s for r in records),
                                                     default=0.0)) > 0 else math.nan,
        request_throughput=len(ok) / wall,
        output_throughput=sum(r.completion_tokens or 0 for r in ok) / wall,
        goodput=good / wall,
        rejection_rate=rejected / n if n else math.nan,
        error_rate=errors / n if n else math.nan,
        prompt_tokens=sum(r.prompt_tokens or 0 for r in records),
        completion_tokens=sum(r.completion_tokens or 0 for r in records),
        max_send_lag_ms=max((r.send_lag_s * 1000 for r in records), default=0.0),
        slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms,
        ttft=Distribution.of_seconds((r.ttft_s for r in ok if r.ttft_s is not None), percentiles),
        itl=Distribution.of_seconds((g for r in ok for g in r.itl_s), percentiles),
        tpot=Distribution.of_seconds((t for r in ok if (t := r.tpot_s) is not None), percentiles),
        e2e=Distribution.of_seconds((r.e2e_s for r in ok if r.e2e_s is not None), percentiles),
        error_samples=samples,
        total_token_throughput=sum((r.prompt_tokens or 0) + (r.completion_tokens or 0)
                                   for r in ok) / wall,
    )


def _fmt(x: float | None, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:,.{digits}f}"


def _latency_head(s: Summary) -> list[str]:
    return ["latency (ms)", "n", "mean", *(k.upper() for k in s.ttft.chosen)]


def _latency_rows(s: Summary) -> list[list[str]]:
    return [[name, str(d.count), _fmt(d.mean), *(_fmt(v) for v in d.chosen.values())]
            for name, d in (("TTFT", s.ttft), ("ITL", s.itl), ("TPOT", s.tpot), ("E2E", s.e2e))]


def _scalar_rows(s: Summary) -> list[tuple[str, str]]:
    load = (f"open loop, {_fmt(s.offered_rate, 2)} req/s offered" if s.offered_rate is not None
            else f"closed loop, concurrency {s.concurrency}")
    targets = (("TTFT", s.slo_ttft_ms), ("TPOT", s.slo_tpot_ms))
    slo = ", ".join(f"{k} <= {v:g} ms" for k, v in targets if v is not None) or "none"
    return [
        ("load", load),
        ("requests", f"{s.num_requests} ({s.completed} ok, {s.rejected} rejected (429), "
                     f"{s.errors} errors)"),
        ("duration", f"{_fmt(s.duration_s, 2)} s"),
        ("request throughput", f"{_fmt(s.request_throughput, 2)} req/s completed, "
                               f"{_fmt(s.sent_rate, 2)} req/s sent"),
        ("output throughput", f"{_fmt(s.output_throughput, 1)} tok/s"),
        ("total token throughput", f"{_fmt(s.total_token_throughput, 1)} tok/s (prompt + "
                                   "output)"),
        ("goodput", f"{_fmt(s.goodput, 2)} req/s (SLO: {slo})"),
        ("429 rate", f"{_fmt(s.rejection_rate * 100, 1)} %"),
        ("error rate", f"{_fmt(s.error_rate * 100, 1)} %"),
        ("tokens", f"{s.prompt_tokens} prompt, {s.completion_tokens} completion"),
        ("max send lag", f"{_fmt(s.max_send_lag_ms, 2)} ms"),
    ]


def format_table(s: Summary) -> str:
    """A plain-text report for the terminal."""
    head = _latency_head(s)
    rows = [head, *_latency_rows(s)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w)
                       in enumerate(zip(row, widths, strict=True))) for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    key_w = max(len(k) for k, _ in _scalar_rows(s))
    lines += [""] + [f"{k.ljust(key_w)}  {v}" for k, v in _scalar_rows(s)]
    lines += [f"error sample: {e}" for e in s.error_samples]
    return "\n".join(lines)


def markdown_table(head: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def markdown_section(s: Summary, title: str, details: str = "") -> str:
    """One `##` section: the settings line, the latency table, the scalar metrics."""
    parts = [f"## {title}", ""]
    if details:
        parts += [details, ""]
    parts += [markdown_table(_latency_head(s), _latency_rows(s)), ""]
    parts += [markdown_table(["metric", "value"], _scalar_rows(s)), ""]
    return "\n".join(parts) + "\n"


def write_markdown(path: Path, text: str, *, append: bool = True) -> None:
    """Append a section to a report file (separated by a blank line), or replace the file."""
    path = Path(path)
    if append and path.exists() and path.stat().st_size > 0:
        existing = path.read_text()
        sep = "" if existing.endswith("\n\n") else ("\n" if existing.endswith("\n") else "\n\n")
        path.write_text(existing + sep + text)
    else:
        path.write_text(text)
