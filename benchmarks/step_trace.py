"""Where a load's time went, step by step: sums a worker's KESTREL_STEP_TRACE file.

    KESTREL_STEP_TRACE=/tmp/steps.txt kestrel-serve ...   (or any benchmark that starts ours)
    python benchmarks/step_trace.py /tmp/steps.txt [--window 2] [--since SECONDS]

Data flow: the file's lines (the engine's clock, decode rows, prompt rows, seconds: one per
step, engine_worker/step_costs.py) -> per number of decoders, decode-only, mixed and prompt-only
steps apart: how many, their mean time, the prompt rows they carried -> then per --window seconds of
the clock: steps, busy seconds, decode rows (tokens), prompt rows, mean decoders. A load of
16 streams that holds ~9 decoders with the rest waiting for their prompts shows it here.
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path


def read(path: Path) -> list[tuple[float, int, int, float]]:
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            t, d, p, s = line.split()
            out.append((float(t), int(d), int(p), float(s)))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--window", type=float, default=2.0, help="seconds per timeline row")
    ap.add_argument("--since", type=float, default=0.0,
                    help="skip the steps before this many seconds from the first")
    args = ap.parse_args(argv)
    steps = read(args.trace)
    if not steps:
        raise SystemExit(f"{args.trace}: no steps")
    start = steps[0][0]
    steps = [s for s in steps if s[0] - start >= args.since]
    busy = sum(s[3] for s in steps)
    print(f"{len(steps)} steps over {steps[-1][0] - steps[0][0]:.1f} s, {busy:.1f} s busy; "
          f"{sum(s[1] for s in steps)} decode rows, {sum(s[2] for s in steps)} prompt rows")
    kinds: dict[tuple[int, bool], list[float]] = collections.defaultdict(list)
    carried: dict[tuple[int, bool], int] = collections.Counter()
    for _, d, p, s in steps:
        kinds[(d, p > 0)].append(s)
        carried[(d, p > 0)] += p
    print("decoders  kind    steps   mean ms  prompt rows")
    for (d, mixed), secs in sorted(kinds.items()):
        kind = "mixed" if mixed and d else "prompt" if mixed else "decode"
        print(f"{d:8d}  {kind:6s} {len(secs):6d} "
              f"{1e3 * sum(secs) / len(secs):9.1f} {carried[(d, mixed)]:12d}")
    print(f"per {args.window:g} s: start  steps  busy s  tokens  prompt rows  mean decoders")
    windows: dict[int, list] = collections.defaultdict(list)
    for s in steps:
        windows[int((s[0] - start) // args.window)].append(s)
    for w, rows in sorted(windows.items()):
        print(f"{w * args.window:10.0f} {len(rows):6d} {sum(r[3] for r in rows):7.2f} "
              f"{sum(r[1] for r in rows):7d} {sum(r[2] for r in rows):12d} "
              f"{sum(r[1] for r in rows) / len(rows):14.1f}")


if __name__ == "__main__":
    main()
