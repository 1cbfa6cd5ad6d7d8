"""The load generator's newer options against the real server (tiny model, real processes):
a ShareGPT-format file, bursty and regular gamma arrivals (their gaps' coefficient of variation
measured), non-streaming requests, and the automatic sweep with CSV output."""

from __future__ import annotations

import asyncio
import csv
import json
import math
from pathlib import Path

import pytest

from loadgen import LengthDist, LoadConfig, WorkloadConfig, run_load
from loadgen.cli import main as loadgen_main
from loadgen.schedule import coefficient_of_variation

WORDS = "river stone bridge garden window forest island summer winter morning".split()


def sharegpt_file(path: Path, n: int = 16) -> Path:
    """n two-turn ShareGPT conversations; reply i has 1 + i % 3 words (so 1-3 tokens)."""
    rows = [{"id": f"c{i}", "conversations": [
        {"from": "human", "value": " ".join(WORDS[(i + k) % len(WORDS)] for k in range(4 + i % 5))},
        {"from": "gpt", "value": " ".join(WORDS[: 1 + i % 3])}]} for i in range(n)]
    path.write_text(json.dumps(rows))
    return path


@pytest.mark.parametrize("burstiness", [0.5, 2.0])
def test_sharegpt_file_with_gamma_arrivals(tiny_server, tmp_path: Path,
                                           burstiness: float) -> None:
    gw, _ = tiny_server
    n = 60
    result = asyncio.run(run_load(LoadConfig(
        base_url=gw.base_url + "/v1", api="chat", rate=20.0, num_requests=n,
        burstiness=burstiness, seed=5,
        workload=WorkloadConfig(dataset=sharegpt_file(tmp_path / "sharegpt.json")))))
    s = result.summary
    assert s.errors == 0 and s.completed + s.rejected == n, s.error_samples
    assert s.completed >= n // 2
    for r in result.records:
        assert r.target_output_len == 1 + r.index % 16 % 3  # the reply's length, in tokens
        if r.ok:
            assert r.completion_tokens == r.target_output_len
    # The schedule (fixed by the seed) has the gamma law's CV; the sends followed it (within
    # the event loop's jitter on a shared machine: a few ms on 50 ms mean gaps).
    scheduled = [r.scheduled_s for r in result.records]
    sent = sorted(r.sent_s for r in result.records)
    cv_scheduled = coefficient_of_variation(_gaps(scheduled))
    cv_sent = coefficient_of_variation(_gaps(sent))
    print(f"burstiness {burstiness}: CV scheduled {cv_scheduled:.3f}, sent {cv_sent:.3f}, "
          f"theory {1 / math.sqrt(burstiness):.3f}")
    assert cv_scheduled == pytest.approx(1 / math.sqrt(burstiness), rel=0.25)
    assert cv_sent == pytest.approx(cv_scheduled, rel=0.2)


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip([0.0, *times[:-1]], times, strict=True)]


def test_non_streaming_requests(tiny_server) -> None:
    gw, _ = tiny_server
    result = asyncio.run(run_load(LoadConfig(
        base_url=gw.base_url + "/v1", mode="closed", concurrency=2, num_requests=6,
        stream=False, warmup=2,
        workload=WorkloadConfig(LengthDist.fixed(12), LengthDist.fixed(5)))))
    s = result.summary
    assert s.completed == 6 and s.errors == 0
    for r in result.records:
        assert r.completion_tokens == 5 and r.n_chunks == 1 and r.ttft_s is not None
        assert r.ttft_s == pytest.approx(r.e2e_s, abs=0.01)  # one response: TTFT = latency
    assert s.total_token_throughput > s.output_throughput > 0


def test_automatic_sweep_finds_its_rates_and_writes_csv(tiny_server, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    gw, _ = tiny_server
    code = loadgen_main([
        "sweep", "--base-url", gw.base_url + "/v1", "--rates", "auto", "--points", "3",
        "--num-requests", "6", "--prompt-len", "8", "--output-len", "4", "--no-progress",
        "--percentiles", "50,99", "--plot", str(tmp_path / "s.png"),
        "--csv", str(tmp_path / "s.csv")])
    assert code == 0
    data = json.loads((tmp_path / "s.json").read_text())
    auto = data["saturation"] and data["auto"]
    sync, top = auto["synchronous_rate"], auto["max_rate"]
    print(capsys.readouterr().out, f"synchronous {sync:.2f} req/s, saturating {top:.2f} req/s")
    assert 0 < sync and auto["synchronous"]["completed"] == 6
    assert auto["throughput"]["completed"] + auto["throughput"]["rejected"] == 6
    rates = [p["rate"] for p in data["points"]]
    assert rates == pytest.approx([sync] if top <= sync else [sync, (sync + top) / 2, top])
    rows = list(csv.DictReader((tmp_path / "s.csv").open()))
    assert [float(r["rate"]) for r in rows] == pytest.approx(rates)
    assert all(r["ttft_p99_ms"] and r["total_token_throughput"] for r in rows)
