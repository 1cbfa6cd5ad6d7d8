"""engine_worker/step_costs.py and the scheduler's steps sized by it: prompt rows per step from
measured time, never from a token count tuned on another model; and the engine's probe that
measures them at start (the tiny random model)."""

from __future__ import annotations

import math

import pytest

from benchmarks.step_trace import read
from common.step_model import decode_seconds, prefill_row_seconds
from engine_worker.block_manager import BlockManager
from engine_worker.engine import Engine
from engine_worker.model_runner import ModelRunner
from engine_worker.scheduler import Scheduler
from engine_worker.step_costs import (
    AMORTIZE,
    DEFAULT_STEP_FLOOR_S,
    LONG_PROMPT,
    MIN_PROMPT_SHARE,
    PROMPT_SPREAD,
    StepCosts,
)
from tests.engine_worker.test_scheduler import EOS, FakeModel, make_seq

# Measured on a 2-vCPU AMD EPYC (AVX2) for Qwen2.5-Coder-1.5B Q4_K_M (Engine.probe, this wave):
# a decode step of 1 row 58 ms, 16 rows 282 ms; a prompt row ~15 ms, whatever the chunk.
QWEN_15B = {"decode": [(1, 0.058), (4, 0.075), (16, 0.282)], "prefill": [(16, 0.015),
                                                                         (64, 0.015)]}


def costs(model: dict = QWEN_15B, max_rows: int = 512, share: float = 0.5,
          floor_s: float = 0.0) -> StepCosts:
    c = StepCosts(max_rows, share, floor_s)
    for rows, s in model["decode"]:
        c.observe(rows, 0, s)
    for rows, per_row in model["prefill"]:
        c.observe(0, rows, rows * per_row)
    return c


def test_decode_cost_is_linear_between_points_and_extends_from_the_two_widest() -> None:
    pts = [(1.0, 0.05), (16.0, 0.2)]
    assert decode_seconds(pts, 1) == 0.05 and decode_seconds(pts, 16) == 0.2
    assert decode_seconds(pts, 8) == pytest.approx(0.05 + 0.15 * 7 / 15)
    assert decode_seconds(pts, 32) == pytest.approx(0.2 + 0.01 * 16)  # the widest slope
    assert decode_seconds([(4.0, 0.1)], 8) == pytest.approx(0.2)  # one point: no batching gain
    assert decode_seconds([], 4) is None
    buckets = [(16, 0.002), (64, 0.001)]
    assert prefill_row_seconds(buckets, 32) == 0.002  # borrows the bucket below
    assert prefill_row_seconds(buckets, 1) == 0.002  # none below: the nearest above
    assert prefill_row_seconds(buckets, 128) == 0.001


# Measured on the 2-vCPU Zen 5 (AVX512-VNNI) for the same file after the prefetch change: a decode
# step of 1 row 33 ms, 16 rows 80 ms; a prompt row beside them 3.7 ms.
QWEN_15B_ZEN5 = {"decode": [(1, 0.033), (16, 0.080)], "prefill": [(16, 0.0037),
                                                                  (64, 0.0035)]}


def test_with_decoders_a_step_carries_what_fits_in_its_share_of_a_lone_decoders_step() -> None:
    c = costs(QWEN_15B_ZEN5, share=0.75)
    one = c.decode_s(1)
    for decoding in (1, 4, 16):
        rows = c.prefill_rows(decoding)
        base = c.decode_s(decoding)
        assert base is not None and one is not None and rows >= 1
        # the step with its prompt rows stays within 4x a lone decoder's step at share 0.75,
        # whatever the number decoding
        assert c.step_target_s(decoding) == pytest.approx(one / 0.25)
        assert base + rows * c.prefill_row_s(rows) <= c.step_target_s(decoding) * 1.0001
        # and one more row would not have fitted (rows are as many as the share allows)
        assert base + (rows + 1) * c.prefill_row_s(rows + 1) > c.step_target_s(decoding)
    # beside 16 decoders, 14 rows: a 132 ms step. The old bound, 4x the 16 decoders' own step
    # with a 1 s floor, gave 248 rows there, a 1 s step, and a 1 s ITL p99 at 16 streams.
    assert c.prefill_rows(16) == 14


def test_decoders_that_alone_take_the_bound_still_leave_prompts_a_share() -> None:
    """The Zen 3's 16 decoders take 282 ms, more than 2x its 58 ms lone step (share 0.5):
    prompts still progress, at MIN_PROMPT_SHARE of a step."""
    c = costs()
    assert c.step_target_s(16) == pytest.approx(0.282 / (1 - MIN_PROMPT_SHARE))
    assert c.prefill_rows(16) == int(0.282 / (1 - MIN_PROMPT_SHARE) * MIN_PROMPT_SHARE / 0.015)
    assert c.prefill_rows(1) == 3  # beside one decoder: what fits 2x its 58 ms


def test_with_nothing_decoding_prefill_takes_the_row_cap() -> None:
    assert costs(max_rows=512).prefill_rows(0) == 512
    assert costs(max_rows=2048).prefill_rows(0) == 2048


def test_rows_within_a_time_are_priced_at_the_measured_row_cost() -> None:
    """What bounds a step of embedding inputs with nobody decoding (engine.py): at 15 ms a row,
    0.25 s holds 16 rows; unmeasured, the cap; never more than the cap, never under one row."""
    c = costs(max_rows=2048)
    assert c.rows_within(0.25) == 16
    assert c.rows_within(1.5) == 100
    assert c.rows_within(1000.0) == 2048
    assert c.rows_within(0.001) == 1
    assert StepCosts(512).rows_within(0.25) == 512


def test_the_same_policy_gives_a_small_model_larger_chunks() -> None:
    """Tuned on nothing: a model 10x cheaper per row gets its chunk from its own costs."""
    small = {"decode": [(1, 0.012), (4, 0.014), (16, 0.025)],
             "prefill": [(16, 0.0008), (64, 0.0008)]}
    big, little = costs(), costs(small)
    # beside 4 decoders, 2x 12 ms leaves 10 ms at 0.8 ms a row: 12 rows, against 2 for the
    # 1.5B (whose lone step is 5x longer but whose row is 19x dearer)
    assert (little.prefill_rows(4), big.prefill_rows(4)) == (12, 2)


def test_a_chunk_with_a_fixed_cost_carries_rows_enough_to_amortize_it() -> None:
    """SmolLM2 on the Zen 5, beside one decoder: 16 prompt rows add 12 ms, 64 add 48, 256 add
    123 (its prompt rows past 16 leave the stack's path): ~11 ms a chunk whatever its rows,
    0.44 ms a row. Chunks of the few rows the bound allows paid it every step (16 streams fell
    from 432 to 246 tok/s); a step now carries at least AMORTIZE x the fixed cost in rows."""
    smol = {"decode": [(1, 0.0048), (16, 0.0196)],
            "prefill": [(16, 0.012 / 16), (64, 0.0476 / 64), (256, 0.123 / 256)]}
    c = costs(smol, share=2 / 3)
    cost = c.chunk_cost()
    assert cost is not None
    fixed, per_row = cost
    assert fixed == pytest.approx(0.0113, abs=5e-4) and per_row == pytest.approx(0.00044, 0.02)
    least = c.least_rows()
    assert least == math.ceil(AMORTIZE * fixed / per_row) and 90 <= least <= 110
    assert c.prefill_rows(1) == least and c.prefill_rows(16) == least  # the bound allows fewer
    # a chunk whose rows are all its cost (the 1.5B's, in one pass with the decode rows) is
    # held to the bound alone
    flat = costs(QWEN_15B_ZEN5 | {"prefill": [(16, 0.0035), (64, 0.0035), (256, 0.0035)]},
                 share=0.75)
    assert flat.least_rows() == 1 and flat.prefill_rows(16) == 14


def test_unmeasured_costs_give_one_small_chunk_which_measures_them() -> None:
    c = StepCosts(512, prefill_share=0.5, step_floor_s=0.0)
    assert c.prefill_rows(4) == 16
    c.observe(4, 0, 0.1)
    c.observe(4, 16, 0.1 + 16 * 0.01)  # that chunk: 10 ms a row beyond the decode step
    assert c.prefill_row_s(16) == pytest.approx(0.01)
    assert c.prefill_rows(4) == 10  # 0.1 s of room at 10 ms a row


def test_steps_are_measured_into_histograms_for_metrics() -> None:
    c = costs()
    report = c.report()
    assert report.prefill_share == 0.5 and report.max_rows == 512
    assert StepCosts(512).prefill_share == pytest.approx(2 / 3)  # steps at 3x a lone decoder's
    assert dict(report.step_seconds)[float("inf")] == c.steps == 5
    assert report.step_seconds_sum == pytest.approx(0.058 + 0.075 + 0.282 + 16 * 0.015 + 0.96)
    assert dict(report.prefill_rows)[0.0] == 3  # the three decode-only steps
    with pytest.raises(ValueError):
        StepCosts(512, prefill_share=1.0)


def prompt_beside_a_decoder(c: StepCosts | None, prompt: int, rows: int = 512,
                            ) -> tuple[Scheduler, FakeModel]:
    """A scheduler sized by `c` (None: by tokens alone) where "a" (10 tokens) has been
    prefilled alone, with the whole prompt in one step, and now decodes; then "b" of `prompt`
    tokens is added."""
    sched = Scheduler(BlockManager(rows, 4), max_num_seqs=8, max_num_batched_tokens=rows,
                      max_model_len=max(2048, rows), eos_token_ids=[EOS],
                      prefill_rows=None if c is None else c.prefill_rows)
    model = FakeModel()
    sched.add(make_seq("a", 10, max_tokens=100))
    first = sched.schedule()
    assert [ch.num_tokens for ch in first] == [10]  # nothing decodes: the whole prompt
    sched.update(first, model.run(first))
    sched.add(make_seq("b", prompt, max_tokens=5))
    return sched, model


def test_the_scheduler_holds_a_prompt_chunk_to_the_measured_share_while_others_decode() -> None:
    """Before, a step took max_num_batched_tokens (512) prompt rows whatever they cost: on the
    1.5B that was an 8 s step, and every decoder waited for it."""
    c = costs()
    sched, model = prompt_beside_a_decoder(c, 300)
    chunks = sched.schedule()
    decode = [ch for ch in chunks if ch.seq.request_id == "a"]
    prompt = [ch for ch in chunks if ch.seq.request_id == "b"]
    assert [ch.num_tokens for ch in decode] == [1]
    # the measured share: 3 rows (a prompt this short is not a long one)
    assert 300 < LONG_PROMPT
    assert [ch.num_tokens for ch in prompt] == [c.prefill_rows(1, 300)] \
        == [c.prefill_rows(1)] == [3]
    sched.update(chunks, model.run(chunks))
    # the old policy, a token budget alone, would have taken all 300 rows in that step
    plain, _ = prompt_beside_a_decoder(None, 300)
    assert sorted(ch.num_tokens for ch in plain.schedule()) == [1, 300]


def test_a_long_prompt_is_spread_over_about_prompt_spread_steps_beside_a_decoder() -> None:
    """Four conversations each sending a 2,500-token file: under the share alone, ~12 rows a
    step once one decodes (a first-turn TTFT of 126 s on the 1.5B, Ice Lake). The prompt first
    in line may stretch the step to 1/PROMPT_SPREAD of its own prefill, its whole length
    counted (not what is left), so it is done in about PROMPT_SPREAD steps; a prompt shorter
    than LONG_PROMPT keeps the share's rows."""
    c = costs()
    sched, model = prompt_beside_a_decoder(c, 2400, rows=4096)
    steps = 0
    while True:
        chunks = sched.schedule()
        prompt = [ch.num_tokens for ch in chunks if ch.seq.request_id == "b"]
        assert [ch.num_tokens for ch in chunks if ch.seq.request_id == "a"] == [1]
        sched.update(chunks, model.run(chunks))
        steps += 1
        if not prompt or prompt[0] < 2400 // PROMPT_SPREAD:  # its last chunk
            break
    assert PROMPT_SPREAD <= steps <= PROMPT_SPREAD + 1, steps
    # short (chat-sized, 16 streams of 200 tokens): the share decides
    assert c.prefill_rows(1, LONG_PROMPT - 1) == c.prefill_rows(1) == 3


def test_a_prompts_last_block_goes_whole_whatever_the_share() -> None:
    """A warm run (the rows past its cached blocks) is computed in one chunk alone or beside
    decoders: the same rows through the same kernels, so the same numbers."""
    c = costs()  # 3 prompt rows beside one decoder
    # "b": one block (4 rows), more than the 3 allowed
    sched, _ = prompt_beside_a_decoder(c, 4)
    chunks = sched.schedule()
    assert sorted(ch.num_tokens for ch in chunks) == [1, 4]


def test_a_step_with_prompt_rows_may_last_the_floor_whatever_the_share() -> None:
    """Beside one decoder of 58 ms, the share alone gives 3 rows (a 116 ms step); a 1 s floor
    (--step-floor-ms) gives what fits a second."""
    c = costs(floor_s=1.0)
    assert c.step_target_s(1) == 1.0
    assert c.prefill_rows(1) == int((1.0 - 0.058) / 0.015)
    assert costs(floor_s=0.1).prefill_rows(16) == costs().prefill_rows(16)  # the bound is longer
    assert StepCosts(512).step_floor_s == DEFAULT_STEP_FLOOR_S == 0.05


# SmolLM2 under the AVX2 caps on a 2-core Zen 5 (Engine.probe and bench_mixed_step, this wave):
# a lone decoder's step 4 ms, 16 decoders' 21 ms; a prompt row ~0.7 ms beside them.
SMOLLM2_AVX2 = {"decode": [(1, 0.004), (4, 0.0075), (16, 0.021)],
                "prefill": [(16, 0.0008), (64, 0.0007)]}


def test_where_a_lone_decoders_step_is_a_few_ms_prompts_get_the_floor_not_a_tenth() -> None:
    """The bound of 3x a 4 ms step is 12 ms; 16 decoders alone take 21 ms, so without the floor
    prompts get a tenth of a step (~3 rows; the chunk's fixed cost asks for ~13), and under load
    16 streams settled at 3-7 decoding while the rest waited for their prompts (236 tok/s, TTFT
    p50 4.8 s). The default floor lets a step with prompt rows last 50 ms: ~40 rows beside the
    16, and nothing changes where the bound is longer than the floor (the 1.5B Qwen's:
    QWEN_15B's 58 ms step, 3x 174 ms)."""
    off = costs(SMOLLM2_AVX2, share=2 / 3, floor_s=0.0)
    on = costs(SMOLLM2_AVX2, share=2 / 3, floor_s=DEFAULT_STEP_FLOOR_S)
    assert off.step_target_s(16) == pytest.approx(0.021 / (1 - MIN_PROMPT_SHARE))
    # the room (2.3 ms) holds 3 rows; the chunk's fixed cost asks for its amortizing minimum
    assert int((off.step_target_s(16) - 0.021) / 0.0007) <= 3
    assert off.prefill_rows(16) == off.least_rows() < 16
    assert on.step_target_s(16) == DEFAULT_STEP_FLOOR_S
    assert 2.5 * off.prefill_rows(16) < on.prefill_rows(16) <= int((0.05 - 0.021) / 0.0007)
    qwen_off = costs(QWEN_15B, share=2 / 3, floor_s=0.0)
    qwen_on = costs(QWEN_15B, share=2 / 3, floor_s=DEFAULT_STEP_FLOOR_S)
    for decoders in (1, 4, 16):
        assert qwen_on.step_target_s(decoders) == qwen_off.step_target_s(decoders)
        assert qwen_on.prefill_rows(decoders) == qwen_off.prefill_rows(decoders)


def test_the_probe_times_prompt_chunks_beside_one_decoder(tiny_runner: ModelRunner,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Serving carries prompt chunks beside decoders; a prompt-only step pays what they share
    (on the 1.5B Qwen a whole pass over the weights: 6.2 ms a row at 16 rows, against 2.8 beside
    a decoder), so the probe measures the shape serving runs."""
    engine = Engine(tiny_runner, max_num_seqs=4, max_num_batched_tokens=128)
    shapes: list[list[int]] = []
    execute = tiny_runner.execute
    monkeypatch.setattr(tiny_runner, "execute", lambda items, **kw: shapes.append(
        [len(it.token_ids) for it in items]) or execute(items, **kw))
    engine.probe()
    mixed = {tuple(s) for s in shapes if len(s) > 1 and max(s) > 1}
    assert mixed == {(1, 16), (1, 64), (1, 127)}  # 256 capped by the 128-row step, less one
    points = engine.costs.points()
    assert [b for b, _ in points["prefill"]] == [16, 64]  # 127 rows fall in the 64 bucket
    assert [b for b, _, _ in points["decode"]] == [1, 4]


def test_a_step_trace_gets_a_line_per_step_only_when_asked(tmp_path, monkeypatch) -> None:
    """KESTREL_STEP_TRACE: each observed step appended as (clock, decode rows, prompt rows,
    seconds), which benchmarks/step_trace.py reads; nothing written without it."""
    trace = tmp_path / "steps.txt"
    monkeypatch.delenv("KESTREL_STEP_TRACE", raising=False)
    StepCosts(512).observe(3, 0, 0.01)
    assert not trace.exists()
    monkeypatch.setenv("KESTREL_STEP_TRACE", str(trace))
    c = StepCosts(512, clock=lambda: 12.5)
    c.observe(3, 0, 0.01)
    c.observe(2, 40, 0.05)
    c.observe(0, 0, 0.01)  # no rows: not a step
    assert read(trace) == [(12.5, 3, 0, 0.01), (12.5, 2, 40, 0.05)]


def test_where_prompt_rows_ride_the_decode_rows_pass_a_chunk_has_nothing_to_amortize() -> None:
    """The 1.5B Qwen's prompt rows meet its decode rows in the same matmuls. Its kernel does more
    per row at 256 rows than at 16 (2.7 against 3.5 ms), which a linear fit reads as a fixed cost
    of ~12 ms a chunk: ~20 rows a step beside 13 decoders, steps of ~145 ms against a 97 ms
    target (an ITL p99 of 364 ms in one run). With `one_pass` (the runner says so) the bound
    alone sizes the chunk."""
    qwen = QWEN_15B_ZEN5 | {"prefill": [(16, 0.0035), (64, 0.0028), (256, 0.0027)]}
    split = costs(qwen, share=2 / 3)
    fixed, _ = split.chunk_cost() or (0.0, 0.0)
    assert fixed > 0.01 and split.least_rows() > 12
    one = StepCosts(512, 2 / 3, 0.0, one_pass=True)
    one.seed(split.points())
    assert one.least_rows() == 1
    target, base = one.step_target_s(13), one.decode_s(13)
    assert target is not None and base is not None
    rows = one.prefill_rows(13)
    assert base + rows * one.prefill_row_s(rows) <= target < base + (rows + 1) * 0.0035
    assert split.prefill_rows(13) > rows


def test_an_engine_over_a_one_pass_runner_sizes_its_chunks_by_the_bound_alone(
        tiny_runner: ModelRunner) -> None:
    """The tiny model has no stack beside its layers, so a step's prompt rows ride its decode
    rows' pass: the engine's step sizing is told so, and prompt-row buckets that a fit reads
    as a fixed cost ask for no amortizing minimum (test_decode_stack checks the flag where a
    stack serves a K-quant file in one pass)."""
    assert tiny_runner.decode_stack is None and tiny_runner.mixed_steps_one_pass
    engine = Engine(tiny_runner, max_num_seqs=4, max_num_batched_tokens=128)
    assert engine.costs.one_pass
    engine.costs.seed({"decode": [[1, 1, 0.002], [4, 4, 0.003]],
                       "prefill": [[16, 0.0004], [64, 0.0002]]})  # ~4 ms a chunk, fitted
    assert engine.costs.chunk_cost() is not None and engine.costs.least_rows() == 1
