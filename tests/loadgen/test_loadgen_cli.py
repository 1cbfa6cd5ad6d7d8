"""loadgen/cli.py, loadgen/sweep.py and loadgen/plot.py: flags, reports, the sweep and its plot."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from loadgen.cli import build_parser, config_from_args, main
from loadgen.config import LengthDist, LoadConfig, WorkloadConfig
from loadgen.plot import plot_sweep
from loadgen.report import summarize
from loadgen.sweep import SweepPoint, SweepResult, find_saturation, parse_rates, run_sweep
from tests.loadgen.factories import ok_record, rejected_record
from tests.loadgen.fake_openai import FakeOpenAI

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"], ["sweep", "--help"]])
def test_help_works_everywhere(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0
    assert "usage: kestrel-loadgen" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["run", "--prompt-len", "uniform:9"], ["run", "--rate", "0"],
                                  ["run", "--base-url", "localhost"], ["sweep"],
                                  ["sweep", "--rates", "1,-2"], ["run", "--extra-body", "[1]"]])
def test_bad_flags_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_flags_become_a_config() -> None:
    args = build_parser().parse_args(
        ["run", "--base-url", "http://h:1/v1", "--mode", "closed", "--concurrency", "8",
         "--duration", "30", "--prompt-len", "uniform:10,20", "--output-len", "fixed:5",
         "--shared-prefix-frac", "0.5", "--shared-prefix-len", "64", "--no-ignore-eos",
         "--api", "chat", "--seed", "9", "--slo-ttft-ms", "200", "--extra-body", '{"top_k": 1}'])
    cfg = config_from_args(args)
    assert isinstance(cfg, LoadConfig)
    assert (cfg.mode, cfg.concurrency, cfg.duration_s, cfg.num_requests) == ("closed", 8, 30, None)
    assert str(cfg.workload.prompt_len) == "uniform:10,20" and cfg.workload.output_len.low == 5
    assert cfg.workload.shared_prefix_len == 64 and not cfg.ignore_eos and cfg.api == "chat"
    assert cfg.seed == 9 and cfg.slo_ttft_ms == 200 and dict(cfg.extra_body) == {"top_k": 1}
    default = config_from_args(build_parser().parse_args(["run"]))
    assert default.num_requests == 100 and default.rate == 1.0


def test_run_writes_table_json_and_markdown(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    with FakeOpenAI(reject_every=5) as server:
        argv = ["run", "--base-url", server.base_url, "--mode", "open", "--rate", "100",
                "--num-requests", "10", "--prompt-len", "fixed:16", "--output-len", "fixed:4",
                "--api", "chat", "--seed", "0", "--out", str(out), "--markdown", str(md),
                "--api-key", "secret"]
        assert main(argv) == 0
        assert main([*argv, "--title", "second run", "--no-records"]) == 0
    captured = capsys.readouterr()
    assert "TTFT" in captured.out and "P99" in captured.out
    assert "\r[" in captured.err  # the progress line
    data = json.loads(out.read_text())
    assert data["model"] == "fake-model" and "records" not in data  # the second run's file
    s = data["summary"]
    assert (s["num_requests"], s["rejected"], s["completed"]) == (10, 2, 8)
    assert s["completion_tokens"] == 8 * 4 and s["prompt_tokens"] == 8 * 16
    assert "secret" not in out.read_text()  # the API key stays out of shared results
    text = md.read_text()
    assert text.count("## ") == 2 and "## second run" in text and "| TTFT |" in text


def test_run_json_has_records(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    with FakeOpenAI() as server:
        assert main(["run", "--base-url", server.base_url, "--mode", "closed", "--concurrency",
                     "2", "--num-requests", "4", "--output-len", "fixed:3", "--out", str(out),
                     "--no-progress"]) == 0
    records = json.loads(out.read_text())["records"]
    assert [r["n_chunks"] for r in records] == [3, 3, 3, 3]
    assert all(len(r["itl_s"]) == 2 and r["ok"] for r in records)


def test_unreachable_server_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    with FakeOpenAI() as server:
        url = server.base_url
    assert main(["run", "--base-url", url, "--num-requests", "1", "--no-progress"]) == 1
    assert "kestrel-loadgen:" in capsys.readouterr().err


def point(rate: float, ttft_s: float, completed: int, duration_s: float = 10.0,
          rejected: int = 0) -> SweepPoint:
    recs = [ok_record(i, ttft_s, [0.01]) for i in range(completed)]
    recs += [rejected_record(completed + i) for i in range(rejected)]
    return SweepPoint(rate, summarize(recs, duration_s, offered_rate=rate))


def test_find_saturation() -> None:
    healthy = [point(1, 0.1, 10), point(2, 0.12, 20), point(4, 0.2, 40)]
    assert find_saturation(healthy) == (None, None)
    slow = [*healthy, point(8, 0.9, 80), point(16, 3.0, 100)]
    index, reason = find_saturation(slow)
    assert index == 3 and reason is not None and "TTFT" in reason
    shed = [*healthy, point(8, 0.15, 60, rejected=20)]
    index, reason = find_saturation(shed)
    assert index == 3 and reason is not None and "achieved" in reason
    assert parse_rates("4,1,2,2") == [1.0, 2.0, 4.0]


def test_plot_draws_a_png(tmp_path: Path) -> None:
    points = [point(1, 0.1, 10), point(2, 0.12, 20), point(4, 0.9, 30, rejected=10),
              point(8, 0.0, 0, rejected=80)]  # nothing completed: gaps, not a crash
    index, reason = find_saturation(points)
    path = plot_sweep(SweepResult(points, index, reason), tmp_path / "s.png")
    assert path.read_bytes().startswith(PNG_MAGIC) and path.stat().st_size > 10_000


def test_sweep_against_a_fake_server(tmp_path: Path) -> None:
    with FakeOpenAI() as server:
        cfg = LoadConfig(base_url=server.base_url, num_requests=8, timeout_s=30)
        result = asyncio.run(run_sweep(cfg, [50.0, 100.0]))
        png, out, md = tmp_path / "s.png", tmp_path / "s.json", tmp_path / "s.md"
        assert main(["sweep", "--base-url", server.base_url, "--rates", "50,100",
                     "--num-requests", "6", "--output-len", "fixed:3", "--plot", str(png),
                     "--markdown", str(md), "--no-progress"]) == 0  # JSON: next to the PNG
    assert [p.rate for p in result.points] == [50.0, 100.0]
    assert all(p.summary.completed == 8 and p.summary.offered_rate == p.rate
               for p in result.points)
    data = json.loads(out.read_text())
    assert [p["rate"] for p in data["points"]] == [50.0, 100.0]
    assert data["points"][0]["summary"]["completion_tokens"] == 6 * 3
    assert "saturation" in data and data["model"] == "fake-model"
    assert png.read_bytes().startswith(PNG_MAGIC)
    assert "![load sweep](s.png)" in md.read_text()


def test_sweep_finds_the_knee_of_a_server_with_limited_capacity(tmp_path: Path) -> None:
    # Two streams at a time, ~50 ms each: about 40 req/s at most. 10 req/s is comfortable;
    # 120 req/s queues without bound.
    with FakeOpenAI(capacity=2, first_delay_s=0.04, chunk_delay_s=0.002) as server:
        cfg = LoadConfig(base_url=server.base_url, num_requests=16, timeout_s=30,
                         workload=WorkloadConfig(LengthDist.fixed(8), LengthDist.fixed(4)))
        result = asyncio.run(run_sweep(cfg, [10.0, 120.0]))
    assert result.saturation_index == 1 and result.saturation_rate == 120.0
    low, high = (p.summary for p in result.points)
    assert high.ttft.p99 > 3 * low.ttft.p99
    assert plot_sweep(result, tmp_path / "knee.png").read_bytes().startswith(PNG_MAGIC)
