"""The options people compare with `vllm bench serve` and guidellm: gamma arrivals (burstiness),
a concurrency cap with a rate, ShareGPT / OpenAI conversation datasets, warm-up, chosen
percentiles, total token throughput, CSV, the automatic sweep's rates, no flag abbreviation."""

from __future__ import annotations

import asyncio
import csv
import json
import math
from pathlib import Path

import pytest

from loadgen.cli import main
from loadgen.config import LengthDist, LoadConfig, WorkloadConfig, parse_percentiles
from loadgen.csv_out import summary_row, write_csv
from loadgen.dataset import load_dataset
from loadgen.report import format_table, summarize
from loadgen.runner import run_load
from loadgen.schedule import coefficient_of_variation, gaps, poisson_schedule
from loadgen.sweep import auto_rates
from loadgen.workload import Workload, build_request
from tests.loadgen.factories import ok_record
from tests.loadgen.fake_openai import FakeOpenAI


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 2.0, 4.0])
def test_gamma_gaps_have_mean_one_over_rate_and_cv_one_over_sqrt_burstiness(
        burstiness: float) -> None:
    g = gaps(poisson_schedule(10.0, num_requests=20000, seed=7, burstiness=burstiness))
    assert sum(g) / len(g) == pytest.approx(0.1, rel=0.03)
    assert coefficient_of_variation(g) == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_burstiness_one_is_the_poisson_schedule_as_before() -> None:
    import random

    rng = random.Random(3)
    expected, t = [], 0.0
    for _ in range(50):
        t += rng.expovariate(4.0)
        expected.append(t)
    assert poisson_schedule(4.0, num_requests=50, seed=3, burstiness=1.0) == expected


def test_max_concurrency_caps_requests_in_flight_at_a_rate() -> None:
    with FakeOpenAI(chunk_delay_s=0.01) as fake:
        result = asyncio.run(run_load(LoadConfig(
            base_url=fake.base_url, rate=math.inf, num_requests=12, max_concurrency=3,
            workload=WorkloadConfig(LengthDist.fixed(4), LengthDist.fixed(5)))))
    assert result.summary.completed == 12
    assert fake.max_in_flight == 3


def test_warmup_requests_are_sent_first_and_not_recorded() -> None:
    with FakeOpenAI() as fake:
        result = asyncio.run(run_load(LoadConfig(
            base_url=fake.base_url, mode="closed", concurrency=2, num_requests=5, warmup=3,
            workload=WorkloadConfig(LengthDist.fixed(4), LengthDist.fixed(2)))))
    assert fake.count == 8 and len(result.records) == 5
    assert [r.index for r in result.records] == list(range(5))


def write(path: Path, rows: list[dict], jsonl: bool) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) if jsonl else json.dumps(rows))
    return path


SHAREGPT = [
    {"id": "a", "conversations": [{"from": "human", "value": "name three rivers"},
                                  {"from": "gpt", "value": "Nile Amazon Danube"},
                                  {"from": "human", "value": "and lakes?"},
                                  {"from": "gpt", "value": "Superior"}]},
    {"id": "no-user", "conversations": [{"from": "gpt", "value": "hello"}]},
    {"id": "b", "conversations": [{"from": "system", "value": "be brief"},
                                  {"from": "human", "value": "hi"}]},
]


@pytest.mark.parametrize("jsonl", [False, True])
def test_sharegpt_first_user_turn_and_its_reply(tmp_path: Path, jsonl: bool) -> None:
    rows = load_dataset(write(tmp_path / "d", SHAREGPT, jsonl))
    assert [r["messages"] for r in rows] == [
        [{"role": "user", "content": "name three rivers"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]]
    assert rows[0]["answer"] == "Nile Amazon Danube" and "answer" not in rows[1]


def test_openai_messages_dataset_drives_chat_requests(tmp_path: Path) -> None:
    rows = [{"messages": [{"role": "system", "content": "terse"},
                          {"role": "user", "content": [{"type": "text", "text": "two words"}]},
                          {"role": "assistant", "content": "ok then"}]},
            {"prompt": "plain prompt", "output_len": 7}]
    cfg = WorkloadConfig(output_len=LengthDist.fixed(3), dataset=write(tmp_path / "d.jsonl",
                                                                        rows, True))
    first, second = Workload(cfg).take(2)
    assert first.output_len == 2 and second.output_len == 7  # the reply's length; the row's
    _, body = build_request(first, "chat", "m")
    assert body["messages"] == [{"role": "system", "content": "terse"},
                                {"role": "user", "content": "two words"}]
    _, body = build_request(first, "completions", "m", stream=False)
    assert body["prompt"] == "terse\n\ntwo words" and body["stream"] is False
    assert "stream_options" not in body


def test_a_conversation_file_without_user_turns_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no requests"):
        load_dataset(write(tmp_path / "d.json", [SHAREGPT[1]], False))


def test_chosen_percentiles_total_tokens_and_csv(tmp_path: Path) -> None:
    records = [ok_record(i, 0.01 * (i + 1), [0.002] * 3, prompt_tokens=10) for i in range(10)]
    s = summarize(records, 2.0, percentiles=parse_percentiles("99.9,50"))
    assert list(s.ttft.chosen) == ["p50", "p99.9"]
    assert s.ttft.chosen["p50"] == pytest.approx(s.ttft.p50)
    assert s.total_token_throughput == pytest.approx((10 + 4) * 10 / 2.0)
    assert "P99.9" in format_table(s) and "total token throughput" in format_table(s)
    assert s.to_dict()["ttft"]["p95"] is not None  # today's fields stay
    write_csv(tmp_path / "s.csv", [summary_row(s, rate=3.0)])
    (row,) = list(csv.DictReader((tmp_path / "s.csv").open()))
    assert row["rate"] == "3.0" and float(row["ttft_p99.9_ms"]) > float(row["ttft_p50_ms"])
    assert float(row["total_token_throughput"]) == pytest.approx(70.0)


def test_auto_rates_span_synchronous_to_saturating() -> None:
    assert auto_rates(2.0, 10.0, 5) == [2.0, 4.0, 6.0, 8.0, 10.0]
    assert auto_rates(5.0, 4.0, 5) == [5.0]


@pytest.mark.parametrize("argv", [["run", "--burst", "2"], ["run", "--max-conc", "2"],
                                  ["run", "--percentiles", "0,50"],
                                  ["run", "--burstiness", "0"]])
def test_abbreviated_or_bad_new_flags_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
