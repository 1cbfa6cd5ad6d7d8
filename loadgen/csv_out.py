"""CSV output: one row per run (or per sweep point), the summary's numbers flattened.

    Summary ──summary_row──▶ {"request_throughput": .., "ttft_p50_ms": .., ...} ──write_csv──▶ file

Latency columns are `<metric>_<stat>_ms` for the count, the mean and each chosen percentile
(`ttft_p99_ms`, `e2e_p99.9_ms`); error samples are left out (free text; they are in the JSON).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from loadgen.report import Distribution, Summary

LATENCIES = ("ttft", "itl", "tpot", "e2e")


def summary_row(s: Summary, **extra: Any) -> dict[str, Any]:
    row: dict[str, Any] = dict(extra)
    for key, value in s.to_dict().items():
        if key in LATENCIES or key == "error_samples":
            continue
        row[key] = value
    for name in LATENCIES:
        d: Distribution = getattr(s, name)
        row[f"{name}_count"] = d.count
        row[f"{name}_mean_ms"] = _num(d.mean)
        for pct, value in d.chosen.items():
            row[f"{name}_{pct}_ms"] = _num(value)
    return row


def _num(x: float) -> float | None:
    return x if math.isfinite(x) else None


def write_csv(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    """Write rows under one header (the union of their keys, in first-seen order)."""
    fields: dict[str, None] = {}
    for row in rows:
        fields.update(dict.fromkeys(row))
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(fields), restval="")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if v is None else v for k, v in row.items()})
