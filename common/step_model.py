"""A step's cost from measured points: what the worker sizes its steps with and the gateway
admits by. Plain numbers in, seconds out; the worker measures (engine_worker.step_costs), the
Stats heartbeat carries the points, the gateway reads them (gateway.admission.backlog).

    decode_seconds(points, rows): points are (decode rows, seconds of a decode-only step)
    prefill_row_seconds(buckets, rows): buckets are (rows bucket, seconds a prompt row adds)
"""

from __future__ import annotations

from collections.abc import Sequence


def decode_seconds(points: Sequence[tuple[float, float]], rows: int) -> float | None:
    """Seconds of a step with `rows` decode rows; None with no point. Linear between points;
    beyond the widest, the slope of the two widest (one point alone: every row costs the same,
    no batching gain); below the narrowest, the narrowest's time (fewer rows cost no more)."""
    pts = sorted(points)
    if not pts:
        return None
    rows = max(1, rows)
    if rows <= pts[0][0]:
        return pts[0][1]
    for (r0, s0), (r1, s1) in zip(pts, pts[1:], strict=False):
        if rows <= r1:
            return s0 + (s1 - s0) * (rows - r0) / max(r1 - r0, 1e-9)
    r1, s1 = pts[-1]
    if len(pts) == 1:
        return s1 * rows / r1
    r0, s0 = pts[-2]
    return s1 + max(0.0, (s1 - s0) / max(r1 - r0, 1e-9)) * (rows - r1)


def prefill_row_seconds(buckets: Sequence[tuple[int, float]], rows: int) -> float | None:
    """Seconds one prompt row adds to a step carrying `rows` of them; None with no bucket. A
    bucket never measured borrows the nearest measured below it (fewer rows a step cost no less
    a row), else the nearest above."""
    if not buckets:
        return None
    known = dict(buckets)
    below = [b for b in known if b <= rows]
    return known[max(below)] if below else known[min(known)]
