"""loadgen/sse.py, loadgen/record.py and loadgen/report.py on recorded, fake data."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadgen.record import RequestRecord
from loadgen.report import (
    format_table,
    markdown_section,
    meets_slo,
    percentile,
    summarize,
    write_markdown,
)
from loadgen.sse import SSEParser
from tests.loadgen.factories import error_record, ok_record, rejected_record

# A chat stream as kestrel sends it: role preamble, one chunk per token (usage on the last),
# the include_usage chunk, [DONE]; with a keep-alive comment and CRLF line ends mixed in.
CHAT_STREAM = (
    b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
    b'"finish_reason":null}]}\n\n'
    b": keep-alive\n\n"
    b'data: {"choices":[{"index":0,"delta":{"content":"Hel"},"finish_reason":null}]}\r\n\r\n'
    b'data: {"choices":[{"index":0,"delta":{"content":"\xc3\xa9"},"finish_reason":null}]}\n\n'
    b'data: {"choices":[{"index":0,"delta":{"content":""},"finish_reason":null}]}\n\n'
    b'data: {"choices":[{"index":0,"delta":{"content":"!"},"finish_reason":"length"}],'
    b'"usage":{"prompt_tokens":12,"completion_tokens":4,"total_tokens":16}}\n\n'
    b'data: {"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":4,"total_tokens":16}}\n\n'
    b"data: [DONE]\n\n"
)


def test_sse_parser_handles_any_split() -> None:
    whole = SSEParser().feed(CHAT_STREAM)
    assert len(whole) == 7 and whole[-1] == "[DONE]"
    assert json.loads(whole[2])["choices"][0]["delta"]["content"] == "é"
    for cut in range(1, len(CHAT_STREAM)):  # every split point, including inside "é"
        p = SSEParser()
        assert p.feed(CHAT_STREAM[:cut]) + p.feed(CHAT_STREAM[cut:]) + p.flush() == whole


def test_sse_parser_multiline_data_and_unterminated_last_event() -> None:
    p = SSEParser()
    assert p.feed(b"event: x\ndata: a\ndata:b\nid: 3\n\n") == ["a\nb"]
    assert p.feed(b"data: tail") == []
    assert p.flush() == ["tail"]


def test_record_from_a_chat_stream() -> None:
    r = RequestRecord(0, 0.0, status=200)
    sent = 10.0
    events = SSEParser().feed(CHAT_STREAM)
    times = [10.05, 10.25, 10.30, 10.40, 10.60, 10.60, 10.60]
    done = [r.on_event(e, t, sent) for e, t in zip(events, times, strict=True)]
    assert done == [False] * 6 + [True]
    # The preamble is no token; the empty-content chunk is one (held-back text is still a token).
    assert r.n_chunks == 4
    assert r.ttft_s == pytest.approx(0.25)
    assert r.itl_s == pytest.approx([0.05, 0.10, 0.20])
    assert r.tpot_s == pytest.approx((10.60 - 10.25) / 3)
    assert (r.prompt_tokens, r.completion_tokens) == (12, 4)
    assert r.finish_reason == "length" and r.done and r.ok and not r.rejected


def test_tpot_divides_by_the_tokens_when_a_chunk_carries_several() -> None:
    """Speculative decoding sends a step's accepted drafts in one chunk: 3 token chunks carrying
    7 tokens over 0.6 s are 0.1 s a token after the first (vLLM's (last - first) / (tokens -
    1)), not 0.3 s a chunk; without usage, the chunks are all there is to count."""
    r = RequestRecord(0, 0.0, status=200)
    for t, text in ((10.2, "a"), (10.5, "bcd"), (10.8, "efg")):
        r.on_event(json.dumps({"choices": [{"index": 0, "delta": {"content": text},
                                            "finish_reason": None}]}), t, 10.0)
    assert r.n_chunks == 3 and r.tpot_s == pytest.approx(0.6 / 2)
    r.on_event(json.dumps({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 7,
                                                    "total_tokens": 12}}), 10.8, 10.0)
    assert r.completion_tokens == 7 and r.tpot_s == pytest.approx(0.6 / 6)
    assert r.itl_s == pytest.approx([0.3, 0.3])  # gaps stay per chunk, as they arrived


def test_record_error_event_and_bad_payload() -> None:
    r = RequestRecord(0, 0.0, status=200)
    assert not r.on_event('{"error":{"message":"worker lost","code":"worker_lost"}}', 1.0, 0.0)
    assert r.error == "worker lost" and not r.ok and r.failed and not r.rejected
    bad = RequestRecord(1, 0.0, status=200)
    bad.on_event("{not json", 1.0, 0.0)
    assert bad.error is not None and bad.failed


def test_percentile_matches_numpy() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))
    rng = random.Random(0)
    xs = [rng.expovariate(1.0) for _ in range(101)]
    for p in (50, 90, 95, 99):
        assert percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)))


@settings(max_examples=50, deadline=None)
@given(xs=st.lists(st.floats(0, 1e6), min_size=1, max_size=50), p=st.floats(0, 100))
def test_percentile_is_within_range_and_monotone(xs: list[float], p: float) -> None:
    v = percentile(xs, p)
    assert min(xs) <= v <= max(xs)
    assert percentile(xs, min(100.0, p + 1)) >= v


def sample_records() -> list[RequestRecord]:
    return [
        ok_record(0, 0.100, [0.010] * 9, prompt_tokens=20),  # TTFT 100 ms, TPOT 10 ms
        ok_record(1, 0.200, [0.030] * 9, prompt_tokens=20, lag_s=0.004),  # TPOT 30 ms
        ok_record(2, 0.500, [0.010] * 9, prompt_tokens=20),  # TTFT 500 ms
        ok_record(3, 0.150, [], prompt_tokens=20),  # one token: no TPOT
        rejected_record(4),
        rejected_record(5),
        error_record(6),
        error_record(7, status=400),
    ]


def test_summary_counts_rejections_apart_from_errors() -> None:
    s = summarize(sample_records(), 2.0, offered_rate=4.0)
    assert (s.num_requests, s.completed, s.rejected, s.errors) == (8, 4, 2, 2)
    assert s.rejection_rate == pytest.approx(2 / 8)
    assert s.error_rate == pytest.approx(2 / 8)
    assert s.request_throughput == pytest.approx(4 / 2.0)
    assert (s.prompt_tokens, s.completion_tokens) == (80, 31)
    assert s.output_throughput == pytest.approx(31 / 2.0)
    assert s.max_send_lag_ms == pytest.approx(4.0)
    assert s.ttft.count == 4
    assert s.ttft.p50 == pytest.approx(np.percentile([100, 200, 500, 150], 50))
    assert s.ttft.p99 == pytest.approx(np.percentile([100, 200, 500, 150], 99))
    assert s.itl.count == 27 and s.itl.p50 == pytest.approx(10.0)
    assert s.tpot.count == 3 and s.tpot.p99 == pytest.approx(np.percentile([10, 30, 10], 99))
    assert s.e2e.count == 4 and s.e2e.p50 == pytest.approx(np.percentile([190, 470, 590, 150], 50))
    assert s.error_samples == ["HTTP 500: boom", "HTTP 400: boom"]


def test_goodput_meets_every_slo_set() -> None:
    recs = sample_records()
    assert summarize(recs, 2.0).goodput == pytest.approx(4 / 2.0)  # no SLO: every success
    assert summarize(recs, 2.0, slo_ttft_ms=250).goodput == pytest.approx(3 / 2.0)
    assert summarize(recs, 2.0, slo_tpot_ms=20).goodput == pytest.approx(3 / 2.0)
    both = summarize(recs, 2.0, slo_ttft_ms=250, slo_tpot_ms=20)
    assert both.goodput == pytest.approx(2 / 2.0)  # records 0 and 3
    assert not meets_slo(rejected_record(9), None, None)


def test_outputs_table_json_markdown(tmp_path: Path) -> None:
    s = summarize(sample_records(), 2.0, concurrency=4, slo_ttft_ms=250)
    table = format_table(s)
    for word in ("TTFT", "ITL", "TPOT", "E2E", "P99", "goodput", "429 rate", "closed loop"):
        assert word in table
    empty = summarize([rejected_record(0)], 1.0, offered_rate=1.0)
    text = json.dumps(empty.to_dict(), allow_nan=False)  # no NaN in JSON: null instead
    assert json.loads(text)["ttft"]["p50"] is None and "-" in format_table(empty)
    md = markdown_section(s, "Run A", "details here")
    assert md.startswith("## Run A\n") and "| TTFT |" in md and "details here" in md
    path = tmp_path / "r.md"
    write_markdown(path, md)
    write_markdown(path, markdown_section(s, "Run B"))
    both = path.read_text()
    assert both.index("## Run A") < both.index("## Run B")
    write_markdown(path, markdown_section(s, "Run C"), append=False)
    assert "Run A" not in path.read_text() and "Run C" in path.read_text()


def test_a_stream_that_ended_on_its_deadline_is_a_failure_not_a_completion() -> None:
    from loadgen.record import RequestRecord

    timed_out = RequestRecord(index=0, scheduled_s=0.0, status=200, finish_reason="timeout")
    finished = RequestRecord(index=1, scheduled_s=0.0, status=200, finish_reason="length")
    assert timed_out.failed and not timed_out.ok and not timed_out.rejected
    assert finished.ok
