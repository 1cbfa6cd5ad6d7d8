"""What an engine step costs on this host for this model, measured, and how many prefill rows a
step may therefore carry. No torch.

    Engine.probe() at start, then every Engine.step() ──observe(decode_rows, prefill_rows, s)──▶
        decode: seconds of a step by its decode rows (EWMA per bucket 1, 2, 4, ... 256)
        prefill: seconds each prefill row adds to a step (EWMA per bucket 1, 16, 32, ... 4096)
    Scheduler.schedule() ──prefill_rows(decode_rows)──▶ this step's prefill rows
    heartbeat ──report()──▶ m.StepCosts: the gateway's admission estimate and /metrics

The policy (stall-free batching, as Sarathi-Serve's): while sequences decode, a step that carries
prompt rows lasts at most decode(1) / (1 - prefill_share), a multiple of a lone decoder's step,
whatever the number decoding, on any host and any model, because both sides are measured here.
That is what bounds the gaps a client sees between its tokens: issue 36 asks for an ITL p99 within
4x the one-stream ITL p50. The default share, 2/3, aims steps at 3x, not 4x: a client's gap adds
to the engine's step the frames' trip and the host's jitter (the gateway and the clients share
the cores on a small host), about 25 ms at the p99 on the 1.5B Qwen on a 2-core Zen 5, where a
4x aim gave an ITL p99 of 148-157 ms against a 4x bound of 116-140, and a 3x aim 112-126 ms.
Before, the bound was 4x the step of all D decoders with a 1 s floor, and beside 16 decoders a
decoder waited up to 1 s for a prompt chunk (the ITL p99 was 1 s). Where D decoders alone
already take about that long (a slow host, many decoders), prompt rows still get
MIN_PROMPT_SHARE of a step, so prompts always progress. A step only carries prompt rows that
wait, so the bound is a bound, not a quota. Where a step's prompt rows meet its decode rows in
the same matmuls (model_runner.py: every row on the integer-dot kernel), a small chunk costs
its rows; where they take another path beside the decode stack (SmolLM2's bfloat16 copy past
16 rows), any chunk also pays a fixed cost, and a step carrying prompt rows carries at least
enough of them to amortize it (least_rows: fitted from the measured buckets; none where the
runner says its mixed steps are always one pass, `one_pass`). The probe
measures chunks beside one decoder, as serving runs them.

A step carrying prompt rows may always last `step_floor_s` (DEFAULT_STEP_FLOOR_S, 50 ms: 20
tokens a second to every stream, faster than anyone reads), whatever the bound says. Where a
lone decoder's step is a few ms (SmolLM2: 4 ms under the AVX2 caps on a Zen 5, so a 13 ms
bound), 16 decoders alone take more than the bound, prompts got their tenth of ~25 ms, and the
load settled where 3-7 streams decoded while the rest waited seconds for their prompts in
chunks of ~10 rows, each paying a step's fixed cost: 236 tok/s at 16 streams, TTFT p50 4.8 s;
with the floor 349 tok/s, TTFT p50 1.2 s, ITL p50 29 ms (llama-server's 56 ms). Where a lone
decoder's step is long (the 1.5B Qwen: 25-33 ms on the Zen 5, 22 under its AVX2 caps) the bound
is above the floor and the floor changes nothing. With nothing decoding there is nobody to
stall: prefill takes the whole row cap (--max-num-batched-tokens) for throughput.

A long prompt (LONG_PROMPT, 1,024 tokens or more: a file, not a chat turn) is not spread thinner
than PROMPT_SPREAD steps: a step carrying it first in line may last its decoders' step plus 1/16
of that prompt's measured prefill, where that is longer than the bound above. Four conversations
each sending a 2,500-token file to the 1.5B Qwen (Ice Lake, 2 vCPU) got ~12 prompt rows a step
under the bound once the first one decoded: a first-turn TTFT p50 of 126 s against
llama-server's 157, where prompt rows without the bound gave 76 s and 1.4x the output tokens a
second; with the spread 77 s and 1.5x. A decoder beside a 2,500-token prompt then waits ~1.3 s a
token for ~16 steps. Applied to every prompt, the spread also stretched the steps of 16 streams
of 200-token prompts (ITL p99 252 -> 494 ms, 29.6 -> 25.7 tok/s): hence the length.

A mixed step teaches the prefill side what it took beyond the decode estimate; a decode-only step
teaches the decode side. Costs never seen are borrowed from the nearest bucket measured (decode
rows: linearly, from the two nearest), so a first step is never unbounded; `probe` measures a few
shapes before the worker says Hello, so the first requests are sized (and admitted) by a
measurement, not by a guess.
"""

from __future__ import annotations

import bisect
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from common.step_model import decode_seconds, prefill_row_seconds
from protocol import messages as m

log = logging.getLogger("kestrel.engine")

DECODE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PREFILL_BUCKETS = (1, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
# Histogram edges for /metrics: step seconds and prefill rows per step.
STEP_SECONDS_EDGES = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
PREFILL_ROWS_EDGES = (0, 1, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
ALPHA = 0.2  # EWMA weight of the newest step: a few dozen steps make the estimate
AMORTIZE = 4  # a prompt chunk's rows cost at least 4x its fixed cost (least_rows)
DEFAULT_PREFILL_SHARE = 2 / 3  # steps with prompt rows aimed at 3x a lone decoder's (see above)
DEFAULT_STEP_FLOOR_S = 0.05  # ... but they may always last this long (see above)
# Where D decoders alone take the one-stream bound, prompt rows still get this share of a step.
MIN_PROMPT_SHARE = 0.1
LOG_EVERY_S = 30.0  # the sizing is logged when it changes by a quarter, at most this often
# A long prompt first in line may stretch a step carrying it to 1/PROMPT_SPREAD of its own
# prefill (see the module's docstring); long: LONG_PROMPT tokens or more
PROMPT_SPREAD = 16
LONG_PROMPT = 1024


def _bucket(edges: tuple[int, ...], rows: int) -> int:
    """The largest edge <= rows (the first edge for fewer)."""
    return edges[max(0, bisect.bisect_right(edges, rows) - 1)]


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else ALPHA * new + (1 - ALPHA) * old


@dataclass
class _Histogram:
    edges: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per edge, then +Inf; not cumulative
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.edges) + 1)

    def add(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.edges, value)] += 1
        self.total += value

    def cumulative(self) -> list[tuple[float, int]]:
        out, running = [], 0
        for edge, count in zip((*self.edges, float("inf")), self.counts, strict=True):
            running += count
            out.append((float(edge), running))
        return out


class StepCosts:
    def __init__(self, max_rows: int, prefill_share: float = DEFAULT_PREFILL_SHARE,
                 step_floor_s: float = DEFAULT_STEP_FLOOR_S,
                 clock: Callable[[], float] = time.monotonic, one_pass: bool = False) -> None:
        if not 0 < prefill_share < 1:
            raise ValueError(f"prefill_share must be in (0, 1), got {prefill_share}")
        self.max_rows = max_rows  # --max-num-batched-tokens: a cap, never the policy
        self.prefill_share = prefill_share
        self.step_floor_s = step_floor_s  # a step with prompt rows may last this long anyway
        # True where a step's prompt rows always meet its decode rows in the same matmuls
        # (ModelRunner.mixed_steps_one_pass): a chunk then has no cost of its own to amortize
        self.one_pass = one_pass
        # bucket -> (mean decode rows, mean seconds) of decode-only steps
        self._decode: dict[int, tuple[float, float]] = {}
        self._prefill: dict[int, float] = {}  # bucket -> seconds a prefill row adds
        self.step_seconds = _Histogram(STEP_SECONDS_EDGES)
        self.prefill_rows_hist = _Histogram(tuple(float(e) for e in PREFILL_ROWS_EDGES))
        self.steps = 0
        self._clock = clock
        self._logged: tuple[int, float] | None = None  # (rows at 1 decoder, when)
        # KESTREL_STEP_TRACE=FILE: a line per step appended to FILE (clock, decode rows, prompt
        # rows, seconds), to see where a load's time went (benchmarks/step_trace.py sums it)
        self._trace = os.environ.get("KESTREL_STEP_TRACE") or None

    # -- learning ------------------------------------------------------------------------------

    def observe(self, decode_rows: int, prefill_rows: int, seconds: float) -> None:
        """One step ran `decode_rows` one-token rows (drafts included) and `prefill_rows` prompt
        rows in `seconds`."""
        if seconds <= 0 or decode_rows + prefill_rows <= 0:
            return
        if self._trace:
            with open(self._trace, "a") as f:
                f.write(f"{self._clock():.4f} {decode_rows} {prefill_rows} {seconds:.6f}\n")
        self.steps += 1
        self.step_seconds.add(seconds)
        self.prefill_rows_hist.add(float(prefill_rows))
        if prefill_rows == 0:
            b = _bucket(DECODE_BUCKETS, decode_rows)
            rows, secs = self._decode.get(b, (None, None))
            self._decode[b] = (_ewma(rows, float(decode_rows)), _ewma(secs, seconds))
            return
        if decode_rows == 0 and prefill_rows < PREFILL_BUCKETS[1]:
            return  # a few prompt rows alone: a step's fixed cost, not a rate per row
        base = self.decode_s(decode_rows) if decode_rows else 0.0
        if base is None:
            return  # a mixed step with no decode estimate at all says nothing about either part
        per_row = max(seconds - base, 0.0) / prefill_rows
        b = _bucket(PREFILL_BUCKETS, prefill_rows)
        self._prefill[b] = _ewma(self._prefill.get(b), per_row)

    def points(self) -> dict[str, list[list[float]]]:
        """What has been learned, as plain lists (engine_worker/probe_record.py keeps them)."""
        return {"decode": [[b, r, s] for b, (r, s) in sorted(self._decode.items())],
                "prefill": [[b, s] for b, s in sorted(self._prefill.items())]}

    def seed(self, points: dict[str, list[list[float]]]) -> None:
        """Start from `points` (an earlier probe's) instead of measuring: later steps refine
        them as they refine a probe's. ValueError if they are not such points."""
        decode = {int(b): (float(r), float(s)) for b, r, s in points["decode"]}
        prefill = {int(b): float(s) for b, s in points["prefill"]}
        if not decode or not prefill or any(b not in DECODE_BUCKETS for b in decode) \
                or any(b not in PREFILL_BUCKETS for b in prefill) \
                or not all(s > 0 for _, s in decode.values()) \
                or not all(s > 0 for s in prefill.values()):
            raise ValueError("not the points of a probe")
        self._decode, self._prefill = decode, prefill

    # -- estimates -----------------------------------------------------------------------------

    def decode_s(self, rows: int) -> float | None:
        """Seconds of a step with `rows` decode rows and no prefill; None: nothing measured."""
        return decode_seconds(list(self._decode.values()), rows)

    def prefill_row_s(self, rows: int) -> float | None:
        """Seconds one prompt row adds to a step carrying `rows` of them; None: none measured."""
        return prefill_row_seconds(list(self._prefill.items()), _bucket(PREFILL_BUCKETS, rows))

    def step_target_s(self, decode_rows: int) -> float | None:
        """The longest a step with `decode_rows` decoders and prompt rows may last: the share of
        a lone decoder's step, or, where the decoders alone take about that, their step with
        MIN_PROMPT_SHARE left to prompts; the floor where that is longer. None: not measured."""
        one, base = self.decode_s(1), self.decode_s(decode_rows)
        if one is None or base is None:
            return None
        return max(one / (1.0 - self.prefill_share), base / (1.0 - MIN_PROMPT_SHARE),
                   self.step_floor_s)

    def prefill_rows(self, decode_rows: int, prompt: int = 0) -> int:
        """How many prompt rows a step with `decode_rows` decode rows may carry; `prompt`: the
        rows of the prompt first in line (PROMPT_SPREAD: a long one may stretch the step)."""
        cap = max(0, self.max_rows - decode_rows)
        if decode_rows <= 0:
            return cap  # nobody decodes: the cap, for throughput
        base = self.decode_s(decode_rows)
        if base is None or not self._prefill:
            # Not measured yet (probe() does it at start): one small chunk, which measures it.
            return min(cap, PREFILL_BUCKETS[1])
        target = self.step_target_s(decode_rows)
        assert target is not None
        per_row = self.prefill_row_s(min(prompt, cap)) if prompt >= LONG_PROMPT else None
        if per_row:  # a long prompt in at most PROMPT_SPREAD steps beside these decoders
            target = max(target, base + prompt * per_row / PROMPT_SPREAD)
        rows = min(cap, max(self._rows_in(target - base, cap), self.least_rows()))
        self._log_choice(rows, decode_rows, base)
        return rows

    def rows_within(self, seconds: float) -> int:
        """The most prompt rows a step with no decoders carries in about `seconds`, by the
        measured cost of a row: the cap where nothing is measured yet (a row of no known cost
        is priced at nothing)."""
        return min(self.max_rows, self._rows_in(seconds, self.max_rows))

    def _rows_in(self, room: float, cap: int) -> int:
        """The most prompt rows that fit `room` seconds (at least 1), each bucket's rows priced
        at that bucket's measured cost."""
        best = 1
        for i, edge in enumerate(PREFILL_BUCKETS):
            per_row = self.prefill_row_s(edge) or 0.0
            top = PREFILL_BUCKETS[i + 1] - 1 if i + 1 < len(PREFILL_BUCKETS) else cap
            rows = top if per_row <= 0 else min(top, int(room / per_row))
            if rows >= edge:
                best = max(best, rows)
        return best

    def chunk_cost(self) -> tuple[float, float] | None:
        """(seconds, seconds a row): what carrying a prompt chunk adds to a step, whatever its
        rows, and what each row adds, fitted (least squares) to the measured buckets of 16 rows
        and more: a bucket's rows times its cost a row is the chunk's cost. None: fewer than
        two buckets measured."""
        pts = [(float(b), b * s) for b, s in self._prefill.items() if b >= PREFILL_BUCKETS[1]]
        if len(pts) < 2:
            return None
        n = len(pts)
        mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
        sxx = sum((x - mx) ** 2 for x, _ in pts)
        slope = sum((x - mx) * (y - my) for x, y in pts) / sxx
        if slope <= 0:
            return None
        return max(0.0, my - slope * mx), slope

    def least_rows(self) -> int:
        """The fewest prompt rows a step carrying any should carry: enough that the chunk's
        fixed cost is at most 1 / (1 + AMORTIZE) of what its rows add. On SmolLM2 natively,
        whose prompt rows past a few dozen take another path beside the stack, it is ~5 ms
        against 0.5 ms a row, and chunks of a few rows had starved its prompts
        (16 streams: 246 tok/s against 432 with 512-row chunks, Zen 5). Where the prompt rows
        always ride the decode rows' pass (`one_pass`), 1: a chunk has no cost of its own, and
        what a fit takes for one is a kernel doing more per row at 256 rows than at 16 (on the
        1.5B Qwen 3.5 against 2.7 ms), which asked for ~20 rows a step beside 13 decoders: steps
        of ~145 ms against a 97 ms target, an ITL p99 of 364 ms in one run of two."""
        cost = None if self.one_pass else self.chunk_cost()
        if cost is None:
            return 1
        fixed, per_row = cost
        return max(1, min(self.max_rows, math.ceil(AMORTIZE * fixed / per_row)))

    def _log_choice(self, rows: int, decode_rows: int, base: float) -> None:
        now = self._clock()
        last = self._logged
        if last is not None and now - last[1] < LOG_EVERY_S and 0.75 * last[0] <= rows <= \
                1.25 * max(1, last[0]):
            return
        self._logged = (rows, now)
        log.info("step sizing: %d prefill rows with %d decoding (decode step %.1f ms, target "
                 "%.1f ms, %.2f ms a prefill row)", rows, decode_rows, base * 1e3,
                 (self.step_target_s(decode_rows) or 0.0) * 1e3,
                 (self.prefill_row_s(rows) or 0.0) * 1e3)

    def report(self) -> m.StepCosts:
        return m.StepCosts(
            decode_s=sorted(self._decode.values()),
            prefill_row_s=[(b, s) for b, s in sorted(self._prefill.items())],
            prefill_share=self.prefill_share,
            max_rows=self.max_rows,
            step_seconds=self.step_seconds.cumulative(),
            step_seconds_sum=self.step_seconds.total,
            prefill_rows=self.prefill_rows_hist.cumulative(),
            prefill_rows_sum=self.prefill_rows_hist.total,
        )
