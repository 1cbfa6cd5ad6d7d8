"""The hockey-stick plot of a rate sweep, drawn with matplotlib's Agg canvas to a PNG.

    SweepResult ──▶ latency axis: P50/P99 TTFT and E2E (ms, log scale) vs offered req/s
                    second axis: 429 rate (%) ──▶ dashed line at the saturation point ──▶ PNG

It uses a bare Figure with FigureCanvasAgg rather than pyplot, so no global backend or figure
state is touched (safe in a test process, on a headless host, or next to other plotting code).
"""

from __future__ import annotations

import math
from pathlib import Path

from loadgen.sweep import SweepResult


def _ms(x: float) -> float:
    return x if math.isfinite(x) and x > 0 else math.nan  # log axis: gaps, not zeros


def plot_sweep(result: SweepResult, path: Path, title: str = "kestrel load sweep") -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, NullFormatter

    points = [p for p in result.points if math.isfinite(p.rate)]  # an inf rate has no x position
    rates = [p.rate for p in points]
    fig = Figure(figsize=(8, 5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    series = [("TTFT P50", lambda s: s.ttft.p50, "tab:blue", "-"),
              ("TTFT P99", lambda s: s.ttft.p99, "tab:blue", "--"),
              ("E2E P50", lambda s: s.e2e.p50, "tab:orange", "-"),
              ("E2E P99", lambda s: s.e2e.p99, "tab:orange", "--")]
    values: list[float] = []
    for label, get, color, style in series:
        ys = [_ms(get(p.summary)) for p in points]
        values += [y for y in ys if math.isfinite(y)]
        ax.plot(rates, ys, style, color=color, marker="o", label=label)
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel("latency (ms)")
    if values:
        # Log: a saturated point's latency is often 100x the others', and the knee still shows.
        ax.set_yscale("log")
        plain = FuncFormatter(lambda v, _pos: f"{v:g}")  # 200, not 2x10^2
        ax.yaxis.set_major_formatter(plain)
        # Within one decade there may be no major tick at all: label the minor ones then.
        narrow = max(values) < 10 * min(values)
        ax.yaxis.set_minor_formatter(plain if narrow else NullFormatter())
    ax.grid(True, which="both", alpha=0.3)

    ax2 = ax.twinx()
    ax2.plot(rates, [p.summary.rejection_rate * 100 for p in points], ":", color="tab:red",
             marker="s", label="429 rate")
    ax2.set_ylabel("429 rate (%)", color="tab:red")
    ax2.set_ylim(0, 100)

    sat = result.saturation_rate
    if sat is not None and math.isfinite(sat):
        ax.axvline(sat, color="gray", linestyle="-.", linewidth=1.5,
                   label=f"saturation ({sat:g} req/s)")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper left", fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, format="png")
    return path
